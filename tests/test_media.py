"""Chat rows with images, planned: parts checked, images read and hashed, placeholders expanded.

The tiny Kimi-K2.5 checkpoint with its tiktoken tokenizer (real K2.5 layout: <|media_pad|> among
the media tokens) and its image processor settings; vLLM's own processor counts the tokens.
No engine starts here (tests/test_media_engine.py runs the images through vLLM).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.builders import write_jsonl
from tests.support.s3server import s3_env, s3_server  # noqa: F401  (fixtures)

VOCAB = 1024


def _png(path: Path, w: int, h: int, seed: int = 0) -> Path:
    from PIL import Image

    Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path


def image_row(*urls: str, question: str = "What is in it?", answer: str = "A cat.") -> dict:
    parts = [{"type": "text", "text": question}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


TEXT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    from datagen.testmodels.tiny_kimi import make_tiny_kimi
    from datagen.testmodels.tiny_tiktoken import write_kimi_tokenizer

    root = tmp_path_factory.mktemp("media")
    p = make_tiny_kimi(root / "kimi", quantization="none", vocab_size=VOCAB, num_layers=2, write_twin=False)
    write_kimi_tokenizer(p.model, vocab_size=VOCAB)
    return p.model


@pytest.fixture(scope="module")
def tokenizer(kimi):
    from datagen.models.tokenizer import load_tokenizer

    return load_tokenizer(kimi, trust_remote_code=True)


def _plan(kimi, tokenizer, data: Path, max_seq_len: int = 512):
    from datagen.data.planning import prepare_dataset

    return prepare_dataset(data, load_tokenizer=lambda: tokenizer, vocab_size=VOCAB, max_seq_len=max_seq_len, workers=1)


def _vllm_count(kimi, path: Path) -> int:
    """vLLM's own count for one image: its Kimi-K2.5 processor, as vLLM's prompt update calls it."""
    from PIL import Image
    from vllm.transformers_utils.processors.kimi_k25_vision_fused import KimiK25FusedVisionProcessor

    proc = KimiK25FusedVisionProcessor.from_pretrained(str(kimi))
    return proc.media_tokens_calculator({"type": "image", "image": Image.open(path).convert("RGB")})


def test_an_image_row_holds_vllms_count_of_placeholder_tokens_masked_out(kimi, tokenizer, tmp_path):
    from datagen.data.media import PAD_TOKEN

    a, b = _png(tmp_path / "a.png", 90, 60), _png(tmp_path / "b.png", 200, 150, seed=1)
    data = write_jsonl(tmp_path / "d.jsonl", [image_row("a.png", f"file://{b}"), TEXT_ROW, image_row("a.png")])
    d = _plan(kimi, tokenizer, data)
    pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    want = [_vllm_count(kimi, a), _vllm_count(kimi, b)]
    assert want[0] != want[1] and min(want) > 1
    s = d.samples[0]
    assert [m.tokens for m in s.media] == want
    for m in s.media:
        run = s.input_ids[m.offset : m.offset + m.tokens]
        assert (run == pad).all() and (s.loss_mask[m.offset : m.offset + m.tokens] == 0).all()
        assert s.input_ids[m.offset - 1] != pad and s.input_ids[m.offset + m.tokens] != pad
    assert int((s.input_ids == pad).sum()) == sum(want)
    assert s.loss_mask.sum() > 0  # the assistant's answer is still a target
    # the same chat without its images, rendered by the template: every other token is the same
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, {"type": "image_url"},
                                      {"type": "image_url"}]},
         {"role": "assistant", "content": "A cat."}], tokenize=False, add_generation_prompt=False)
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [t for t in s.input_ids.tolist() if t != pad] == [t for t in plain if t != pad]
    assert d.samples[1].media == () and pad not in d.samples[1].input_ids.tolist()
    assert d.samples[2].media[0].sha256 == s.media[0].sha256
    assert {m.path for m in s.media} == {str(a.resolve()), str(b.resolve())}


def test_a_changed_image_changes_its_rows_identity_and_nothing_else(kimi, tokenizer, tmp_path):
    _png(tmp_path / "a.png", 90, 60)
    data = write_jsonl(tmp_path / "d.jsonl", [image_row("a.png"), TEXT_ROW])
    before = _plan(kimi, tokenizer, data)
    _png(tmp_path / "a.png", 90, 60, seed=7)  # same size: the same tokens, other pixels
    after = _plan(kimi, tokenizer, data)
    assert before.fingerprint == after.fingerprint  # the file's bytes did not change
    assert before.line_hashes[0] != after.line_hashes[0]
    assert before.line_hashes[1] == after.line_hashes[1]
    assert before.shard_rows_hash(0, 2) != after.shard_rows_hash(0, 2)
    assert np.array_equal(before.samples[0].input_ids, after.samples[0].input_ids)
    (tmp_path / "a.png").unlink()  # gone: its row is skipped, and when it is back its row counts as changed
    gone = _plan(kimi, tokenizer, data)
    assert [s.reason for s in gone.skipped] == ["media_missing"]
    assert gone.line_hashes[0] not in (before.line_hashes[0], after.line_hashes[0])
    assert gone.line_hashes[1] == before.line_hashes[1]


def test_unusable_images_skip_their_rows_with_a_reason(kimi, tokenizer, tmp_path):
    _png(tmp_path / "ok.png", 60, 60)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    _png(tmp_path / "big.png", 448, 448)  # the tiny processor's whole patch budget: 64 tokens
    rows = [image_row("ok.png"), image_row("missing.png"), image_row("broken.png"), image_row("big.png", "big.png"),
            TEXT_ROW]
    d = _plan(kimi, tokenizer, write_jsonl(tmp_path / "d.jsonl", rows), max_seq_len=128)
    assert {s.row: s.reason for s in d.skipped} == {1: "media_missing", 2: "media_unreadable", 3: "media_too_long"}
    assert sorted(d.samples) == [0, 4]


@pytest.mark.parametrize("content, says", [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}], "not fetched over the network"),
    ([{"type": "image", "image": "a.png"}], "part 0 must be an object with type text or image_url"),
    ([{"type": "image_url", "image_url": {}}], "non-empty url"),
    ([{"type": "text", "text": 3}], "string text"),
    (["a.png"], "part 0 must be an object"),
])
def test_malformed_parts_stop_planning_at_their_line(kimi, tokenizer, tmp_path, content, says):
    from datagen.errors import DatasetError

    rows = [TEXT_ROW, {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(DatasetError, match=says) as e:
        _plan(kimi, tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))
    assert e.value.line == 2


def test_images_outside_a_user_message_are_refused(kimi, tokenizer, tmp_path):
    from datagen.errors import DatasetError

    # (a list of text parts alone is the text, in any message: datagen.data.row_formats)
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "a.png"}}]
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": parts}]}]
    with pytest.raises(DatasetError, match=r"message 1 \(assistant\).*only user messages"):
        _plan(kimi, tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))


def test_a_model_without_an_image_processor_refuses_image_rows(kimi, tokenizer, tmp_path):
    import shutil

    from datagen.errors import ModelError
    from datagen.models.tokenizer import load_tokenizer

    model = tmp_path / "text-only"
    shutil.copytree(kimi, model)
    (model / "preprocessor_config.json").unlink()
    _png(tmp_path / "a.png", 60, 60)
    with pytest.raises(ModelError, match="no preprocessor_config.json"):
        _plan(model, load_tokenizer(model, trust_remote_code=True), write_jsonl(tmp_path / "d.jsonl", [image_row("a.png")]))


def test_without_vllms_own_processor_a_checkpoint_without_its_code_is_refused(kimi, monkeypatch, tmp_path):
    """vLLM 0.24.0 has no Kimi-K2.5 image processor of its own: it loads the checkpoint's remote
    code. The tiny checkpoint ships it; one whose preprocessor_config.json names none is refused
    before the engine starts (tests/test_kimi_processor.py holds the shipped one's count)."""
    import shutil

    from datagen.data import media_processor as media
    from datagen.errors import EngineUnsupportedError

    monkeypatch.setattr(media, "fused_processor_class", lambda: None)
    assert media.engine_kwargs(str(kimi), trust_remote_code=True) == {"mm_processor_cache_gb": 0}
    bare = tmp_path / "no-code"
    shutil.copytree(kimi, bare)
    cfg = json.loads((bare / "preprocessor_config.json").read_text())
    del cfg["auto_map"]
    (bare / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineUnsupportedError, match="ships none"):
        media.engine_kwargs(str(bare), trust_remote_code=True)


def test_a_shard_job_carries_each_rows_images_over_the_wire():
    from datagen.data.media import MediaItem
    from datagen.data.contract import ShardFormat
    from datagen.data.shards.format import ShardJob

    item = MediaItem(url="a.png", path="/data/a.png", sha256="ab" * 32, offset=5, tokens=12)
    job = ShardJob(index=0, path="/x", first_row=0, rows=2, sample_rows=(0, 1),
                   input_ids=(np.arange(20, dtype=np.int32), np.arange(3, dtype=np.int32)),
                   loss_masks=(np.ones(20, np.uint8), np.ones(3, np.uint8)), format=ShardFormat((1, 2), "bfloat16", 8),
                   shard_key="k", media=((item,), ()))
    wire = json.loads(json.dumps(job.to_wire()))
    back = ShardJob.from_wire(wire, job.format)
    assert back.media == ((item,), ())
    text_only = ShardJob.from_wire({**wire, "media": []}, job.format)
    assert text_only.media == ()


def test_the_engine_prompt_gives_vllm_one_placeholder_per_image(tmp_path):
    from datagen.data.media import MediaItem
    from datagen.data.media_tokens import collapse, engine_prompt
    from datagen.errors import DatasetError

    img = _png(tmp_path / "a.png", 30, 30)
    import hashlib

    sha = hashlib.sha256(img.read_bytes()).hexdigest()
    ids = np.array([1, 2, 9, 9, 9, 3, 9, 9, 4], np.int32)
    items = (MediaItem("a.png", str(img), sha, 2, 3), MediaItem("a.png", str(img), sha, 6, 2))
    assert collapse(ids, items) == [1, 2, 9, 3, 9, 4]
    p = engine_prompt(ids, items)
    assert [c["uuid"] for c in p["multi_modal_data"]["vision_chunk"]] == [sha, sha]
    _png(img, 30, 30, seed=3)  # changed after planning: refused, not run
    with pytest.raises(DatasetError, match="changed since the plan"):
        engine_prompt(ids, items)


@pytest.mark.s3
def test_s3_images_are_read_through_the_storage_layer_and_kept_by_sha256(kimi, tokenizer, tmp_path, s3_server, s3_env,
                                                                          monkeypatch):
    import hashlib

    from datagen.storage import s3

    monkeypatch.setenv("DATAGEN_MEDIA_CACHE", str(tmp_path / "cache"))
    s3._media_client.cache_clear()
    bucket = s3_server.create_bucket()
    img = _png(tmp_path / "a.png", 90, 60)
    s3_server.client().put_object(Bucket=bucket, Key="imgs/a.png", Body=img.read_bytes())
    rows = [image_row(f"s3://{bucket}/imgs/a.png"), image_row(f"s3://{bucket}/imgs/none.png"), image_row("a.png")]
    try:
        d = _plan(kimi, tokenizer, write_jsonl(tmp_path / "d.jsonl", rows))
    finally:
        s3._media_client.cache_clear()
    sha = hashlib.sha256(img.read_bytes()).hexdigest()
    (item,) = d.samples[0].media
    assert item.sha256 == sha and Path(item.path).parent.parent == tmp_path / "cache"
    assert Path(item.path).read_bytes() == img.read_bytes()
    assert {s.row: s.reason for s in d.skipped} == {1: "media_missing"}
    assert np.array_equal(d.samples[0].input_ids, d.samples[2].input_ids)  # the same image, wherever it lies


def test_the_transformers_engine_refuses_image_rows_and_leaves_no_output(kimi, tmp_path):
    """Through `datagen`'s `main` in the test's process (a `datagen extract` program took 16 s in
    the suite, most of it imports); the refusal as tests/faults/_refusal.py holds every refusal."""
    from datagen.specs.extraction import ExtractSpec
    from tests.faults._refusal import run_cli

    _png(tmp_path / "a.png", 60, 60)
    data = write_jsonl(tmp_path / "d.jsonl", [image_row("a.png"), TEXT_ROW])
    spec = ExtractSpec(model=str(kimi), dataset=str(data), out=str(tmp_path / "out"), layer_ids=[1, 2],
                       max_seq_len=256, engine={"name": "hf", "trust_remote_code": True})
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    o = run_cli("extract", "--spec", tmp_path / "spec.json")
    assert o.code != 0, o.err[-2000:]
    assert "image rows and the transformers engine runs no vision tower" in o.err, o.err[-2000:]
    assert "Traceback" not in o.err, o.err[-3000:]
    assert not (tmp_path / "out").exists()


def test_the_steps_mount_the_directories_of_the_images_the_rows_reference(tmp_path, monkeypatch):
    from datagen.data.media_sources import sources
    from datagen.specs.extraction import ExtractSpec
    from tasks.extract import range_call
    from tasks.mounts import extract_mounts
    from tasks.plan import plan_call
    from tasks.pipeline_spec import ShardRange
    from tests.support.plan_records import plan_record

    data_dir, elsewhere, linked = tmp_path / "data", tmp_path / "elsewhere", tmp_path / "linked"
    for d in (data_dir / "imgs" / "a", data_dir / "imgs" / "b", elsewhere, linked):
        d.mkdir(parents=True)
    _png(data_dir / "imgs" / "a" / "1.png", 8, 8)
    _png(elsewhere / "2.png", 8, 8)
    (data_dir / "imgs" / "b" / "3.png").symlink_to(_png(linked / "3.png", 8, 8))
    text = write_jsonl(data_dir / "text.jsonl", [TEXT_ROW] * 3)
    assert sources(text).dirs == () and not sources(text).remote  # a text dataset mounts nothing more
    rows = [image_row("imgs/a/1.png"), image_row((elsewhere / "2.png").as_uri(), "imgs/b/3.png"), TEXT_ROW,
            image_row(str(tmp_path / "gone" / "4.png")), image_row("imgs/missing.png"), "not json image_url"]
    data = write_jsonl(data_dir / "d.jsonl", rows)
    # the dataset's directory once (every relative path lies under it), the file:// image's, a
    # symlink's target; not the directory of an image that is gone (a bind mount needs its source)
    assert sources(data).dirs == tuple(sorted(map(str, (data_dir, elsewhere, linked))))
    assert not sources(data).remote

    out = data_dir / "out" / "ds"  # the output inside a mounted read-only directory stays read-write
    spec = ExtractSpec(model=str(tmp_path / "m"), dataset=str(data), out=str(out), layer_ids=[1])
    # out's parent does not exist yet: its nearest ancestor, the dataset's directory, is mounted read-write
    mounts = {m.path: m.read_only for m in extract_mounts(spec)}
    assert mounts == {str(data_dir): False, str(elsewhere): True, str(linked): True, str(data): True,
                      str(tmp_path / "m"): True}, mounts
    (data_dir / "out").mkdir()
    mounts = {m.path: m.read_only for m in extract_mounts(spec)}
    assert mounts[str(data_dir / "out")] is False and mounts[str(data_dir)] is True

    # s3:// images: the steps that read the rows get the S3 settings and the credentials by name
    assert plan_call(spec).secret_env_names == ()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.example:8333")
    s3_data = write_jsonl(tmp_path / "s3.jsonl", [image_row("s3://bucket/a.png")])
    assert sources(s3_data) == sources(s3_data) and sources(s3_data).remote and sources(s3_data).dirs == ()
    s3_spec = spec.model_copy(update={"dataset": str(s3_data)})
    for call in (plan_call(s3_spec), range_call(plan_record(spec=s3_spec), ShardRange(first=0, stop=1))):
        assert call.secret_env_names == ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        assert call.env["AWS_ENDPOINT_URL"] == "http://s3.example:8333"


@pytest.mark.docker
def test_a_plan_step_in_its_container_sees_every_image_and_an_output_inside_stays_writable(kimi, tokenizer, tmp_path):
    """The mounts as Docker makes them: `datagen plan` in the extract image plans the image rows as
    this process does (an image it could not see would skip its row), and inside the read-only
    dataset directory the output directory is writable and nothing else is."""
    from datagen.specs.extraction import ExtractSpec
    from images.tags import ImageName
    from tasks.step_files import spec_file
    from tasks.docker_runner import DockerRunner
    from tasks.mounts import extract_mounts
    from tasks.plan import plan_call
    from tasks.runners import Mount, StepInvocation
    from tests.support.docker_engine import built_images

    data_dir, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    (data_dir / "imgs").mkdir(parents=True)
    elsewhere.mkdir()
    _png(data_dir / "imgs" / "a.png", 90, 60)
    _png(elsewhere / "b.png", 40, 30, seed=1)
    data = write_jsonl(data_dir / "d.jsonl", [image_row("imgs/a.png", (elsewhere / "b.png").as_uri()), TEXT_ROW,
                                              image_row("imgs/gone.png")])
    (data_dir / "out").mkdir()
    spec = ExtractSpec(model=str(kimi), dataset=str(data), out=str(data_dir / "out" / "ds"), layer_ids=[1, 2],
                       max_seq_len=512, engine={"name": "vllm", "trust_remote_code": True})
    here = _plan(kimi, tokenizer, data)
    assert {s.row: s.reason for s in here.skipped} == {2: "media_missing"}

    tags = built_images(ImageName.STEPS, ImageName.EXTRACT_CPU)
    runner = DockerRunner({"*": tags[ImageName.STEPS], "plan": tags[ImageName.EXTRACT_CPU]})
    call = plan_call(spec)
    with spec_file(call.spec) as path:
        outcome = runner.run(StepInvocation(step="plan", args=("--spec", str(path)),
                                            mounts=(*call.mounts, Mount(str(path.parent), read_only=True))),
                             lambda line: None)
    assert outcome.ok, outcome.last_lines
    assert outcome.result["tokens"] == here.tokens and outcome.result["rows"] == 3

    def make_tiny(out: Path):
        return runner.run(StepInvocation(step="make-tiny", args=("--out", str(out), "--arch", "llama", "--layers", "1",
                                                                  "--rows", "1"), mounts=extract_mounts(spec)),
                          lambda line: None)

    assert make_tiny(data_dir / "out" / "tiny").ok  # the read-write output inside the read-only directory
    assert (data_dir / "out" / "tiny" / "chat.jsonl").is_file()
    assert not make_tiny(data_dir / "tiny").ok and not (data_dir / "tiny").exists()  # the directory itself is not
