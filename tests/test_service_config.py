"""`fleetctl config show`: one config file, env and flags on top, each value's source, no secret shown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleet.config import load_settings

FLEETCTL = str(Path(sys.executable).parent / "fleetctl")
SECRET = "s3cret-key-never-printed-0123456789"


def fleetctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    return subprocess.run([FLEETCTL, *args], capture_output=True, text=True, timeout=120, env={**clean, **env})


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "config.toml").write_text('port = 7800\nworkers = 2\npreload = ["a", "b"]\nlog_level = "debug"\n'
                                          '[[upstream]]\nname = "b"\nurl = "http://b:7744"\nkey_env = "B_KEY"\n')
    return tmp_path


def test_sources_and_precedence_in_json(home):
    proc = fleetctl("config", "show", "--json", "--device", "cpu", "--port", "7900",
                    env={"FLEET_HOME": str(home), "FLEET_WORKERS": "3", "FLEET_API_KEY": SECRET})
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    s = doc["settings"]
    assert doc["config_file"] == str(home / "config.toml") and doc["config_file_found"] is True
    assert s["home"] == {"value": str(home), "source": "env"}
    assert s["port"] == {"value": 7900, "source": "flag"}  # flag beats file
    assert s["workers"] == {"value": 3, "source": "env"}  # env beats file
    assert s["preload"] == {"value": ["a", "b"], "source": "file"}
    assert s["device"] == {"value": "cpu", "source": "flag"}
    assert s["host"] == {"value": "127.0.0.1", "source": "default"}
    assert s["api_key"] == {"value": "set", "source": "env"}
    assert s["upstream"] == {"value": [{"name": "b", "url": "http://b:7744", "kind": "fleet", "key_file": "",
                                        "key_env": "B_KEY"}], "source": "file"}
    assert SECRET not in proc.stdout + proc.stderr


def test_toml_output_is_a_config_file_that_loads_to_the_same_settings(home, tmp_path_factory, monkeypatch):
    env = {"FLEET_HOME": str(home), "FLEET_API_KEY": SECRET, "FLEET_TIMEOUT_MS": "1234"}
    proc = fleetctl("config", "show", "--host", "::1", env=env)
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout
    assert "# api_key: set  # env" in proc.stdout
    assert "port = 7800  # file" in proc.stdout and "timeout_ms = 1234  # env" in proc.stdout
    parsed = tomllib.loads(proc.stdout)
    assert "api_key" not in parsed and "home" not in parsed
    # Written back as config.toml elsewhere, it gives the same settings (minus home and key).
    other = tmp_path_factory.mktemp("copy")
    (other / "config.toml").write_text(proc.stdout)
    for key in [k for k in os.environ if k.startswith("FLEET_")]:
        monkeypatch.delenv(key)
    copy = load_settings(home=str(other))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    original = load_settings(host="::1")
    for field in parsed:
        assert getattr(copy, field) == getattr(original, field), field


def test_key_from_a_file_is_reported_as_such(home):
    key = home / "key"
    key.write_text(SECRET + "\n")
    proc = fleetctl("config", "show", "--json", env={"FLEET_HOME": str(home), "FLEET_API_KEY_FILE": str(key)})
    s = json.loads(proc.stdout)["settings"]
    assert s["api_key"] == {"value": "set", "source": "api_key_file"}
    assert s["api_key_file"] == {"value": str(key), "source": "env"}
    assert SECRET not in proc.stdout


def test_no_config_file_means_defaults(tmp_path):
    proc = fleetctl("config", "show", "--json", env={"FLEET_HOME": str(tmp_path)})
    doc = json.loads(proc.stdout)
    assert doc["config_file_found"] is False
    assert doc["settings"]["api_key"] == {"value": "unset", "source": "default"}
    assert {v["source"] for k, v in doc["settings"].items() if k != "home"} == {"default"}


def test_an_empty_list_variable_empties_the_list_and_an_empty_scalar_one_is_unset(home):
    # FLEET_PRELOAD="" is how a test or a unit says "preload nothing"; an empty
    # FLEET_WORKERS or FLEET_API_KEY leaves the file's value or the default.
    proc = fleetctl("config", "show", "--json", env={"FLEET_HOME": str(home), "FLEET_PRELOAD": "",
                                                      "FLEET_WORKERS": "", "FLEET_API_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)["settings"]
    assert s["preload"] == {"value": [], "source": "env"}
    assert s["workers"] == {"value": 2, "source": "file"}
    assert s["api_key"] == {"value": "unset", "source": "default"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("prt = 1\n", "unknown field `prt`"),
        ('port = "many"\n', "Expected `int`"),
        ("port = \n", "is not valid TOML"),
    ],
)
def test_bad_config_is_one_clear_error_line(tmp_path, content, message):
    (tmp_path / "config.toml").write_text(content)
    proc = fleetctl("config", "show", env={"FLEET_HOME": str(tmp_path)})
    assert proc.returncode == 1
    assert message in proc.stderr and str(tmp_path / "config.toml") in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_key_file_is_reported(tmp_path):
    proc = fleetctl("config", "show", env={"FLEET_HOME": str(tmp_path), "FLEET_API_KEY_FILE": str(tmp_path / "nope")})
    assert proc.returncode == 1 and "cannot read" in proc.stderr and "nope" in proc.stderr


def test_path(tmp_path):
    proc = fleetctl("config", "path", env={"FLEET_HOME": str(tmp_path)})
    assert proc.stdout.strip() == str(tmp_path / "config.toml")
