"""Loading the tokenizer that turns chat rows into tokens: the model's own, or one the spec names.

A model may ship its tokenizer as code (``auto_map`` in tokenizer_config.json, loaded with
``trust_remote_code``). When that code cannot run under the installed transformers (Kimi's
released ``tokenization_kimi.py`` imports ``bytes_to_unicode`` from
``transformers.models.gpt2.tokenization_gpt2``, which transformers 5 removed), the error says so
and names the way on: a tokenizer named in the spec (for Kimi, the fast tokenizer
``python -m datagen.models.kimi_tokenizer`` converts once from the model's own ranks and checks
id for id against the slow one).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path

from datagen.errors import ModelError
from datagen.models.modelinfo import has_tokenizer_files

CONFIG_FILE = "tokenizer_config.json"


def shipped_code_files(d: Path) -> set[str]:
    """The Python files a tokenizer directory's ``auto_map`` names (``module.Class`` -> module.py)."""
    try:
        auto = json.loads((d / CONFIG_FILE).read_text()).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    names = []
    for v in auto.values() if isinstance(auto, dict) else []:
        names += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)]
    return {n.split("--")[-1].rsplit(".", 1)[0] + ".py" for n in names}


def _failed_in_shipped_code(e: BaseException, files: set[str]) -> str | None:
    """The shipped file (of ``files``) in whose import or run ``e`` was raised, or None."""
    for frame in traceback.extract_tb(e.__traceback__):
        p = Path(frame.filename)
        if p.name in files and "transformers_modules" in p.parts:
            return p.name
    return None


def _fix_hint(d: Path) -> str:
    if (d / "tiktoken.model").is_file():
        return (f"convert it once to a fast tokenizer checked against these ranks: "
                f"python -m datagen.models.kimi_tokenizer {d} TOKENIZER_DIR, then set \"tokenizer\": "
                f"\"TOKENIZER_DIR\" in the spec (or pre-tokenize the dataset)")
    return ("name a tokenizer that runs under the installed transformers in the spec's \"tokenizer\" "
            "(a directory with tokenizer.json), or pre-tokenize the dataset")


def load_tokenizer(model: str | Path, *, tokenizer: str | Path | None = None, trust_remote_code: bool = False):
    """The tokenizer for a model's chat rows: ``tokenizer`` when given, else the model's own.

    Args:
        model: the model directory.
        tokenizer: a tokenizer directory named by the spec, used instead of the model's.
        trust_remote_code: whether the model's own tokenizer code may run (the spec's engine setting).

    Raises:
        ModelError: no tokenizer files, shipped code that cannot run under the installed
            transformers, a tokenizer transformers cannot load, or no chat template.
    """
    import transformers
    from transformers import AutoTokenizer

    d = Path(tokenizer if tokenizer is not None else model)
    whose = f"tokenizer {d} named in the spec" if tokenizer is not None else f"the tokenizer of {model}"
    if not d.is_dir() or not has_tokenizer_files(d):
        raise ModelError(
            f"the dataset has chat rows but {whose} has no tokenizer files",
            hint="name a tokenizer directory in the spec's \"tokenizer\"" if tokenizer is not None else
                 "add the tokenizer files to the model directory, name a tokenizer in the spec, or pre-tokenize the dataset",
        )
    files = shipped_code_files(d)
    try:  # slow or fast; shipped code (Kimi's tokenization_kimi.py) only when the spec allows it
        tok = AutoTokenizer.from_pretrained(d, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - the shipped code may raise anything; each case says what to do
        shipped = _failed_in_shipped_code(e, files) if trust_remote_code else None
        if shipped is not None:
            raise ModelError(
                f"{whose} is shipped as code ({shipped}) that cannot run under the installed transformers "
                f"{transformers.__version__}: {type(e).__name__}: {e}",
                hint=_fix_hint(d),
            ) from e
        if files and not trust_remote_code and isinstance(e, (OSError, ValueError)):
            raise ModelError(f"{whose} is shipped as code ({', '.join(sorted(files))}) and the spec does not allow it to run",
                             hint="set engine.trust_remote_code=true for a model source you trust, or name a "
                                  "tokenizer in the spec") from e
        if not isinstance(e, (OSError, ValueError, ImportError)):
            raise
        raise ModelError(f"transformers cannot load {whose}: {e}",
                         hint="name a tokenizer that loads in the spec's \"tokenizer\", or pre-tokenize the dataset") from e
    if not getattr(tok, "chat_template", None):
        raise ModelError(f"{whose} has no chat template",
                         hint="add chat_template.jinja (or chat_template in tokenizer_config.json), or pre-tokenize the dataset")
    return tok

