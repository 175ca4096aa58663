"""`make demo`: the embedded default end to end on this machine, no server.

    python -m flows.demo             # make the tiny model and dataset if missing, run extract/tiny
    python -m flows.demo --prepare   # only make them (before `prefect deployment run extract/tiny`)

The tiny model (a random DeepSeek-V3: MLA + routed MoE, 4 layers) and its chat dataset are made
where the ``tiny`` deployment of prefect.yaml expects them (``.cache/demo/``). The run is the
deployment's own flow with the deployment's own parameters (``python -m flows.extract
--deployment tiny``) in Prefect's ephemeral mode: no PREFECT_API_URL, a Prefect home of its own
under ``.cache/demo/prefect`` (a second demo finds its cache there: every range is Cached). The
last line printed is ``dataset: <path>``.

No Prefect import here (datagen/ runs inside the step containers): the flow runs as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from flows._deployments import deployment_parameters

ROOT = Path(__file__).resolve().parent.parent  # the project's root: prefect.yaml, flows/
DEPLOYMENT = "tiny"
TINY_LAYERS = 4
TINY_ROWS = 32
RESULT_LINE_PREFIX = "extract-result: "  # flows.extract prints its summary after it


def tiny_spec(root: Path = ROOT) -> dict:
    """The ``tiny`` deployment's spec, as prefect.yaml gives it."""
    return deployment_parameters(DEPLOYMENT, path=root / "prefect.yaml")["spec"]


def prepare(root: Path = ROOT) -> tuple[Path, Path]:
    """Make the tiny model and dataset where the deployment reads them, unless they exist.

    Each is written under a temporary name and renamed, so an interrupted run leaves nothing that
    later passes for complete.
    """
    from datagen.testmodels.tiny import TinyArch, make_chat_dataset, make_model

    spec = tiny_spec(root)
    model, dataset = root / spec["model"], root / spec["dataset"]
    if not (model / "config.json").exists():
        tmp = model.with_name(model.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        make_model(tmp, arch=TinyArch.DEEPSEEK_V3, num_layers=TINY_LAYERS, seed=0)
        shutil.rmtree(model, ignore_errors=True)
        tmp.rename(model)
    if not dataset.exists():
        tmp = dataset.with_name(dataset.name + ".partial")
        make_chat_dataset(tmp, rows=TINY_ROWS, seed=0)
        tmp.rename(dataset)
    return model, dataset


def ephemeral_env(root: Path = ROOT) -> dict[str, str]:
    """This environment, without a Prefect server, with the demo's own Prefect home."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(root / ".cache" / "demo" / "prefect")
    env.setdefault("DATAGEN_ENFORCE_EAGER", "1")  # no torch.compile warm-up: the CPU engine starts faster
    # The ephemeral server can take more than Prefect's default 20 s to come up on a busy 2-core
    # machine; and this machine reaches no telemetry endpoint.
    env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


def run_flow(root: Path = ROOT) -> dict:
    """Run the tiny deployment's flow; its output goes to this terminal. Returns its summary."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.extract", "--deployment", DEPLOYMENT],
        cwd=root, env=ephemeral_env(root), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )
    summary = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(RESULT_LINE_PREFIX):
            summary = json.loads(line[len(RESULT_LINE_PREFIX):])
        else:
            sys.stdout.write(line)
    if proc.wait() != 0 or summary is None:
        raise SystemExit(f"demo: the extract flow failed (exit {proc.returncode}); its log is above")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--prepare", action="store_true", help="only make the tiny model and dataset")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    model, dataset = prepare()
    print(f"demo: tiny DeepSeek-V3 model at {model}, {TINY_ROWS}-row chat dataset at {dataset}", flush=True)
    if args.prepare:
        return 0
    s = run_flow()
    totals = s["totals"]
    print()
    print("demo: extract/tiny (CPU vLLM engine, local runner, Prefect ephemeral mode)")
    print(f"  fingerprint      {s['fingerprint']}")
    print(f"  shards           {totals['shards']} ({len(s['shards_extracted'])} extracted now, "
          f"{s['ranges_cached']} of {s['ranges']} ranges from the cache)")
    print(f"  samples, tokens  {totals['samples']}, {totals['tokens']}")
    print(f"  bytes            {totals['bytes']:,}")
    print(f"  wall time        {time.monotonic() - t0:.0f} s")
    print(f"dataset: {s['dataset']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
