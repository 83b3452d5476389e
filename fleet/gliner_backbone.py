"""The backbone of a GLiNER checkpoint as the hub holds it, fetched at pull.

A GLiNER folder saved by an older `gliner` (urchade/gliner_multi-v2.1 and its
kin) is `gliner_config.json` and the weights: the config names its backbone
(`model_name`, e.g. microsoft/mdeberta-v3-base) but carries neither the
backbone's config (`encoder_config`) nor its tokenizer; the `gliner` package
fetches both from the hub at every load, adds its `<<ENT>>`/`<<SEP>>` tokens to
the tokenizer and sizes the embeddings to it. fleet loads offline: the pull
fetches the backbone's config and tokenizer files into `backbone/` of the model's
folder (`fetch_backbone`), hashed into the manifest like every other file, and
runtimes.adapters.gliner builds the model from there.

`model_name` is a hub repo id (downloaded through huggingface_hub, so its cache
serves it offline) or, as GLiNER allows, a local folder (copied).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fleet.errors import SourceUnreachable

BACKBONE_DIR = "backbone"
#: What GLiNER reads of its backbone: the config, and the tokenizer in whichever form the repo has it.
BACKBONE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "spm.model", "sentencepiece.bpe.model", "vocab.txt", "vocab.json",
                  "merges.txt")
#: Files that hold a tokenizer's vocabulary (one is needed besides the config).
VOCAB_FILES = ("tokenizer.json", "spm.model", "sentencepiece.bpe.model", "vocab.txt", "vocab.json")


def needed_backbone(folder: Path) -> str | None:
    """The backbone (`model_name`) a GLiNER folder needs fetched: when its config has no
    `encoder_config` or the folder no tokenizer; None for any other folder."""
    try:
        config = json.loads((folder / "gliner_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if config.get("encoder_config") and (folder / "tokenizer_config.json").is_file():
        return None
    name = config.get("model_name")
    return name if isinstance(name, str) and name else None


def fetch_backbone(model_name: str, into: Path, origin: str) -> list[str]:
    """Put the backbone's config and tokenizer files into `into`; their names there."""
    into.mkdir(parents=True, exist_ok=True)
    local = Path(model_name).expanduser()
    if local.is_dir():
        got = [name for name in BACKBONE_FILES if (local / name).is_file()]
        for name in got:
            shutil.copyfile(local / name, into / name)
    else:
        got = _download(model_name, into, origin)
    if "config.json" not in got or not any(name in got for name in VOCAB_FILES):
        raise SourceUnreachable(
            f"cannot pull {origin}: its GLiNER config names the backbone {model_name!r} for its config and "
            f"tokenizer, and {'its config.json' if 'config.json' not in got else 'no tokenizer'} could be "
            f"fetched from it", hint="pull once with the hub reachable (the backbone is fetched at pull, then "
                                     "kept in the model's folder)")
    return got


def _download(repo: str, into: Path, origin: str) -> list[str]:
    """The files of BACKBONE_FILES the hub repo `repo` has, downloaded into `into`."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub import errors as hub_errors
    except ModuleNotFoundError:
        raise SourceUnreachable(f"cannot pull {origin}: huggingface_hub is not installed",
                                hint="pip install huggingface_hub") from None
    got = []
    for name in BACKBONE_FILES:
        try:
            hf_hub_download(repo, name, local_dir=into, etag_timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except (hub_errors.EntryNotFoundError, hub_errors.LocalEntryNotFoundError):
            continue  # the repo has no such file (or, offline, it is not in the cache)
        except (hub_errors.HfHubHTTPError, OSError, ValueError) as exc:
            raise SourceUnreachable(f"cannot pull {origin}: fetching {name} of its backbone {repo!r} failed: "
                                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        got.append(name)
    shutil.rmtree(into / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping: not a model file
    return got
