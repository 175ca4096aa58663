"""Where models and datasets live: model sources and their spec (``sources``), the local model
cache (``model_cache``), the Hugging Face Hub (``hub``), S3 (``s3``, model mirrors ``s3_mirror``)
the bucket a fanned-out run writes its dataset to (``fleet``), and a validated dataset published
to S3 (``publish``, the library of the `publish` step)."""
