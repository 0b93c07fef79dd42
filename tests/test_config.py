"""paratrain/config.py: every PARATRAIN_* variable in one table, read in one place,
and the README's settings table naming the same variables."""
import pathlib
import re

import pytest

from paratrain import config

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_settings():
    text = (ROOT / "README.md").read_text()
    table = text.split("### Settings (environment)", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(PARATRAIN_[A-Z_]+)`", "\n".join(l.split("|")[1] for l in table.splitlines()
                                                               if l.startswith("| `PARATRAIN_"))))


def test_the_readme_table_names_exactly_the_settings():
    assert readme_settings() == set(config.SETTINGS)


def test_no_other_module_reads_a_paratrain_variable_from_the_environment():
    read = re.compile(r"""(os\.environ\.get|os\.getenv|environ\.get)\(\s*["']PARATRAIN_"""
                      r"""|os\.environ\[\s*["']PARATRAIN_[A-Z_]+["']\s*\](?!\s*=[^=])""")
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for path in sorted((ROOT / "paratrain").rglob("*.py")) if path.name != "config.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if read.search(line)]
    assert offenders == []


def test_every_variable_named_in_the_code_is_in_the_table():
    names = set()
    for path in (ROOT / "paratrain").rglob("*.py"):
        names |= set(re.findall(r"\b(PARATRAIN_[A-Z_]*[A-Z])\b", path.read_text()))
    assert names - set(config.SETTINGS) == set()


def test_defaults_and_parsing(monkeypatch):
    for name in config.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert config.get("PARATRAIN_TIMEOUT") == 300.0
    assert config.get("PARATRAIN_DEBUG") is False and config.get("PARATRAIN_CMA") is True
    assert config.get("PARATRAIN_SHM_SLOT_BYTES") == 1 << 20
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "12.5")
    monkeypatch.setenv("PARATRAIN_SHM_SLOT_BYTES", "256K")
    monkeypatch.setenv("PARATRAIN_DEBUG", "yes")
    monkeypatch.setenv("PARATRAIN_CMA", "0")
    monkeypatch.setenv("PARATRAIN_PS_BELLS", "")   # empty is unset
    assert config.get("PARATRAIN_TIMEOUT") == 12.5
    assert config.get("PARATRAIN_SHM_SLOT_BYTES") == 256 << 10
    assert config.get("PARATRAIN_DEBUG") is True and config.get("PARATRAIN_CMA") is False
    assert config.get("PARATRAIN_PS_BELLS") is True


@pytest.mark.parametrize("name, value", [("PARATRAIN_TIMEOUT", "soon"), ("PARATRAIN_TIMEOUT", "-1"),
                                         ("PARATRAIN_SHM_SLOT_BYTES", "1T"), ("PARATRAIN_PRETEND_HOSTS", "0"),
                                         ("PARATRAIN_PS_CHECKPOINT_CLOCKS", "-3")])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        config.get(name)
    assert name in str(e.value) and repr(value) in str(e.value) and config.SETTINGS[name].meaning in str(e.value)


def test_a_variable_the_launcher_sets_is_required(monkeypatch):
    monkeypatch.delenv("PARATRAIN_PS_BIND", raising=False)
    with pytest.raises(RuntimeError, match="PARATRAIN_PS_BIND is not set"):
        config.require("PARATRAIN_PS_BIND")
