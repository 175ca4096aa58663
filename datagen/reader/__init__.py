"""Training reads the packed shards directly: no export, no per-sample files.

    from datagen.reader import open_dataset, SampleDataset, ShardStreamDataset

    reader = open_dataset("s3://bucket/datasets/kimi-2026-11-30")   # or a directory
    loader = DataLoader(ShardStreamDataset(reader, seed=0), batch_size=None, num_workers=8)

Opening reads the manifest and, per shard, its header and small tensors (a few ranged reads);
each sample is then one ranged read of its hidden states. fp8 shards are dequantized to the
reader's dtype (bf16 by default). Shards whose size, header, shard key, layers or sha256 disagree
with the manifest are refused (``ShardRefused``, a ``ValidationFailed``): never trained on.
``Verify`` says how the sha256 is checked (docs/decisions.md has the trade-off).

Needs torch and safetensors' format only (boto3 for S3); no Prefect. The speculators adapter is
``datagen.reader.for_speculators``.
"""

from datagen.reader._dataset import DatasetReader, Sample, Verify, open_dataset
from datagen.reader._shards import ShardRefused
from datagen.reader.torch_data import SampleDataset, ShardStreamDataset

__all__ = ["DatasetReader", "Sample", "SampleDataset", "ShardRefused", "ShardStreamDataset", "Verify",
           "open_dataset"]
