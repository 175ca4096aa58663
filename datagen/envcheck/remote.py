"""The remotes: an S3 output is writable, and a gated Hub model has its token."""

from __future__ import annotations

from datagen.envcheck.report import Check, Status
from datagen.specs.source import HubSource, SourcesSpec, is_s3_uri


def check_remote_output(spec: SourcesSpec) -> Check:
    if not is_s3_uri(spec.out):
        return Check(name="remote.output", status=Status.SKIPPED, detail="output is local")
    from datagen.storage import s3
    from datagen.specs.source import parse_s3_uri

    dest = parse_s3_uri(spec.out)
    s3.probe_writable(s3.make_client(), dest)
    return Check(name="remote.output", status=Status.OK, detail=f"{dest.uri} is writable (probe written, read, deleted)")


def check_hub_token(spec: SourcesSpec) -> Check:
    src = spec.source
    if not isinstance(src, HubSource):
        return Check(name="remote.hub_token", status=Status.SKIPPED, detail="model is not on the Hub")
    from huggingface_hub import HfApi, constants, get_token

    has_token = get_token() is not None
    if constants.HF_HUB_OFFLINE:
        return Check(name="remote.hub_token", status=Status.OK, detail=f"HF_HUB_OFFLINE=1: the cache is used; token {'present' if has_token else 'absent'}")
    from datagen.storage.hub import _translate_hub_error

    try:
        gated = HfApi().model_info(src.repo_id, revision=src.revision).gated
    except Exception as e:  # noqa: BLE001  (every Hub error, translated: gated, missing, down)
        raise _translate_hub_error(e, src) from e
    if gated and not has_token:
        return Check(
            name="remote.hub_token",
            status=Status.FAILED,
            detail=f"{src.repo_id} is gated ({gated}) and no Hub token is set",
            fix="accept the model's terms on the Hub and set HF_TOKEN (or run `hf auth login`)",
        )
    return Check(name="remote.hub_token", status=Status.OK, detail=f"gated: {gated or 'no'}; token {'present' if has_token else 'absent'}")
