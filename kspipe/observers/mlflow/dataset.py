"""The data set a run trained on, as the run's input in MLflow (the runs table's dataset
column): a :class:`kspipe.contracts.TrainingData`, its digest worked out here, in the
recorder process, from the files it names (:func:`kspipe.files.files_digest`)."""

from __future__ import annotations

import hashlib
import json

from kspipe.files import files_digest

#: The context MLflow shows beside a run's input.
CONTEXT = "training"


def log_dataset(
    client, run_id: str, name: str, source: str, files=(), digest: str = "", profile=None
) -> str:
    """Log the data set ``name`` from ``source`` as the input of the run ``run_id``, with
    ``digest`` (else the digest of ``files``; of neither, of its name and source); return
    the digest."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    if not digest:
        named = hashlib.sha256(f"{name}\0{source}".encode()).hexdigest()[:8]
        digest = files_digest(files) if files else named
    dataset = Dataset(
        name=name,
        digest=digest,
        source_type="local" if files else "code",
        source=json.dumps({"uri": source}),
        profile=json.dumps(profile) if profile else None,
    )
    tags = [InputTag(MLFLOW_DATASET_CONTEXT, CONTEXT)]
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])
    return digest
