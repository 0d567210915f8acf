"""Reading what experiment trackers recorded, for the tests (tests/test_trackers.py, tests/test_elastic.py,
tests/test_slurm_training.py): MLflow's runs through its client, W&B's offline runs from the files it writes."""

import json
import struct
from pathlib import Path


def mlflow_runs(uri: str, experiment: str) -> list[dict]:
    """Each run of the experiment: name, status and the steps at which ``train/loss`` was logged, oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} at {uri}"
    runs = []
    for r in sorted(client.search_runs([found.experiment_id]), key=lambda r: r.info.start_time):
        steps = sorted(m.step for m in client.get_metric_history(r.info.run_id, "train/loss"))
        runs.append({"id": r.info.run_id, "name": r.info.run_name, "status": r.info.status, "steps": steps})
        runs[-1]["metrics"] = sorted(r.data.metrics)
    return runs


def wandb_records(path: Path):
    """The protobuf records of a W&B ``.wandb`` file (LevelDB's log format: 32 KiB blocks of checksummed chunks)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # the block's tail is padding
            position += left
            continue
        chunk, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 1:  # a whole record
            yield chunk
        elif kind in (2, 3):  # its first or a middle part
            pending = (pending if kind == 3 else b"") + chunk
        elif kind == 4:  # its last part
            yield pending + chunk


def wandb_segments(folder: Path) -> list[dict]:
    """Each offline segment W&B wrote (a start of the run): its run id, name, and the steps ``train/loss`` was at."""
    from wandb.proto import wandb_internal_pb2

    segments = []
    for file in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        segment = {"id": None, "name": None, "steps": []}
        for raw in wandb_records(file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                segment.update(id=record.run.run_id, name=record.run.display_name)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "train/loss" in items:
                    segment["steps"].append(items["trainer/global_step"])
        segments.append(segment)
    return segments
