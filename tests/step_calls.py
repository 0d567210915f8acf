"""A test-only task: the tests' own classifier, counting its ``training_step`` calls per rank.

tests/test_model_parallel.py checks with it what docs/model-parallel.md says of the pipeline's first stage: it runs
each step twice per micro-batch."""

import json
import os
from pathlib import Path

from tests.tiny import TinyClassifier


class CountingClassifier(TinyClassifier):
    calls = 0

    def training_step(self, batch, batch_idx: int):
        self.calls += 1  # code before the network's call: a side effect of the kind the docs warn about
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        folder = Path(os.environ["STEP_CALLS_DIR"])
        (folder / f"rank{self.global_rank}.json").write_text(json.dumps({"training_step": self.calls}))
