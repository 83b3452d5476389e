"""`fleetctl config show | path`: the settings a `fleetctl serve` here would use, and why.

Values come from `fleet.config.load_settings` itself (one resolver); this
module only works out which layer each one came from. The API key is never
printed: only whether it is set, and from where.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import typer

from fleet.config import Settings, client_url, client_url_source, default_home, env_value, load_settings
from fleet.errors import BadRequest

SECRET = "api_key"
#: Secrets that may be set in the file but are shown only as set/unset (NATS auth).
_MASKED = ("nats_token", "nats_password")
#: Fields shown as comments in the TOML output: not settable from config.toml
#: (home decides where config.toml is) or secret.
_NOT_IN_FILE = ("home", SECRET)


def _toml_string(text: str) -> str:
    # TOML basic string: escape quote, backslash and control characters; the rest stays UTF-8.
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, msgspec.Struct):  # an `[[upstream]]` entry: an inline table
        value = msgspec.to_builtins(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted, so any name is valid TOML
        return "{" + ", ".join(f"{_toml_string(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for setting value {value!r}: this is a bug")


def read_file_layer(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest(f"{path} is not valid TOML: {exc}", hint=f"fix it, or move it away: mv {path} {path}.bad") from None


def resolve(flags: dict[str, Any]) -> tuple[Settings, dict[str, str], Path]:
    """(settings, field -> source, config file). Sources: default, file, env, flag."""
    flags = {k: v for k, v in flags.items() if v is not None}
    home = flags.get("home") or default_home()
    cfg = Path(home) / "config.toml"
    file_layer = read_file_layer(cfg)
    settings = load_settings(**flags)  # a bad file or value: BadRequest, one line

    sources: dict[str, str] = {}
    for field in Settings.__struct_fields__:
        if field in flags:
            sources[field] = "flag"
        elif env_value(field) is not None:
            sources[field] = "env"
        elif field in file_layer and field != "home":  # load_settings ignores home in the file
            sources[field] = "file"
        else:
            sources[field] = "default"
    if settings.api_key and sources[SECRET] == "default":
        sources[SECRET] = "api_key_file"  # read from the file that api_key_file names
    return settings, sources, cfg


def render_toml(settings: Settings, sources: dict[str, str], cfg: Path) -> str:
    lines = [
        f"# fleet settings: defaults < {cfg} ({'found' if cfg.is_file() else 'absent'})"
        " < FLEET_* environment < flags",
        f"# home = {toml_value(settings.home)}  # {sources['home']} (set by FLEET_HOME or --home)",
        f"# api_key: {'set' if settings.api_key else 'unset'}  # {sources[SECRET]}",
        f"# url = {toml_value(client_url())}  # {_url_source()} (FLEET_URL: where the CLI finds the daemon)",
    ]
    for field in Settings.__struct_fields__:
        if field in _MASKED:
            lines.append(f"# {field}: {'set' if getattr(settings, field) else 'unset'}  # {sources[field]}")
        elif field not in _NOT_IN_FILE:
            lines.append(f"{field} = {toml_value(getattr(settings, field))}  # {sources[field]}")
    return "\n".join(lines) + "\n"


def render_json(settings: Settings, sources: dict[str, str], cfg: Path) -> str:
    values = {
        field: {
            "value": (("set" if getattr(settings, field) else "unset") if field == SECRET or field in _MASKED
                      else getattr(settings, field)),
            "source": sources[field],
        }
        for field in Settings.__struct_fields__
    }
    url = {"value": client_url(), "source": _url_source()}
    return json.dumps({"config_file": str(cfg), "config_file_found": cfg.is_file(), "url": url, "settings": values},
                      indent=2, default=msgspec.to_builtins) + "\n"  # `[[upstream]]` entries are Structs


def _url_source() -> str:
    return client_url_source()[1]


def register(app: typer.Typer) -> None:
    config = typer.Typer(help="Show the settings in effect and where each came from.", no_args_is_help=True)
    app.add_typer(config, name="config")

    @config.command()
    def show(
        as_json: bool = typer.Option(False, "--json", help="JSON instead of TOML."),
        home: str = typer.Option(None, help="FLEET_HOME to read config.toml from."),
        host: str = typer.Option(None, help="As `fleetctl serve --host`."),
        port: int = typer.Option(None, help="As `fleetctl serve --port`."),
        workers: int = typer.Option(None, help="As `fleetctl serve --workers`."),
        device: str = typer.Option(None, help="As `fleetctl serve --device`."),
        nats: str = typer.Option(None, help="As `fleetctl serve --nats`."),
    ) -> None:
        """Print the settings `fleetctl serve` would use here (TOML, or --json), with sources."""
        settings, sources, cfg = resolve(
            {"home": home, "host": host, "port": port, "workers": workers, "device": device, "nats": nats})
        sys.stdout.write((render_json if as_json else render_toml)(settings, sources, cfg))

    @config.command()
    def path(home: str = typer.Option(None, help="FLEET_HOME to use.")) -> None:
        """Print the path of config.toml (whether or not it exists)."""
        sys.stdout.write(str(Path(home or default_home()) / "config.toml") + "\n")
