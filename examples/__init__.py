"""Example tasks beside the default one (app/model.py, app/data.py): each uses the template's machinery with no
change to it, exactly as a fork's own task would (docs/fork.md)."""
