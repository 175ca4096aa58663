import sys

from datagen.cli import main

# The guard matters: vLLM starts its engine processes with "spawn" on CUDA, which re-imports
# the main module in each child.
if __name__ == "__main__":
    sys.exit(main())
