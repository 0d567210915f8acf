"""Example tasks beside the default one (app/fashion_mnist/): each uses the template's machinery with no change to
it, exactly as a fork's own task would (docs/fork.md)."""
