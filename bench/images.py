"""Measures the images and the docker runner: `python -m bench.images` (images built first).

Prints each default image's size, the time of a `make images` that has nothing to build,
and the runner's overhead per step: the same trivial step (`datagen make-tiny --help`,
which imports every step module and exits) run N times by the local runner and by the
docker runner, median wall time of each; and the container lifecycle alone (a container that
runs `true`), which is what the runner adds to any step.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import docker

from images.tags import DEFAULT_IMAGES, ROOT, ImageName, resolve_image
from tasks.docker_runner import DockerRunner
from tasks.local_runner import LocalRunner
from tasks.runners import StepInvocation

TRIVIAL = StepInvocation(step="make-tiny", args=("--help",), labels={"measure": "overhead"})


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        outcome = run(TRIVIAL, lambda line: None)
        times.append(time.perf_counter() - started)
        assert outcome.ok, outcome.last_lines
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    client = docker.from_env()

    for name in DEFAULT_IMAGES:
        image = client.images.get(resolve_image(name, client=client).tag)
        print(f"size {image.tags[0]}: {image.attrs['Size'] / 1e9:.2f} GB")

    started = time.monotonic()
    subprocess.run([sys.executable, "images/build.py"], cwd=ROOT, check=True, capture_output=True)
    print(f"make images with nothing to build: {time.monotonic() - started:.2f} s")

    steps = resolve_image(ImageName.STEPS, client=client).tag
    local = _median_seconds(LocalRunner().run, args.repeats)
    container = _median_seconds(DockerRunner({"*": steps}, client=client).run, args.repeats)
    print(f"trivial step, median of {args.repeats}: local {local:.2f} s, docker {container:.2f} s,"
          f" overhead {container - local:.2f} s per step")
    print(f"container lifecycle alone (create, start, logs, wait, inspect, remove of `true`), "
          f"median of {args.repeats}: {_lifecycle_seconds(client, steps, args.repeats):.2f} s")
    return 0


def _lifecycle_seconds(client, image: str, repeats: int) -> float:
    """What the runner adds to any step, without the step: a container that runs `true`."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        container = client.containers.create(image, [], entrypoint=["true"], shm_size="8g")
        container.start()
        list(container.logs(stream=True, follow=True))
        container.wait()
        container.reload()
        container.remove(force=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
