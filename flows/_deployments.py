"""The deployments of prefect.yaml, read without a server: for `python -m flows.extract --deployment
tiny` (what `make demo` runs) and for the tests that check the deployments' parameters."""

from __future__ import annotations

from pathlib import Path

import yaml

PREFECT_YAML = Path(__file__).resolve().parent.parent / "prefect.yaml"


def deployments(path: Path = PREFECT_YAML) -> dict[str, dict]:
    """Deployment name -> its section of prefect.yaml."""
    doc = yaml.safe_load(path.read_text())
    return {d["name"]: d for d in doc.get("deployments", [])}


def deployment_parameters(name: str, *, path: Path = PREFECT_YAML) -> dict:
    """The parameters deployment ``name`` runs its flow with.

    Raises:
        KeyError: prefect.yaml has no deployment of that name.
    """
    found = deployments(path)
    if name not in found:
        raise KeyError(f"prefect.yaml has no deployment {name!r}; it has {sorted(found)}")
    return dict(found[name].get("parameters") or {})
