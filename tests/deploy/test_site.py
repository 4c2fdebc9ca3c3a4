"""The site file's schema: what it accepts, and one line for what it does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from allocator import __version__
from allocator.deploy.cli import main
from allocator.deploy.site import Role, SiteError, load_site, summary
from tests.support.site_files import SITE, write_site


def line_of(text: str, needle: str, after: str = "") -> int:
    """The line (from 1) where ``needle`` first stands in ``text`` after ``after``."""
    start = text.index(after)
    return text.count("\n", 0, text.index(needle, start)) + 1


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(SiteError) as raised:
        load_site(write_site(tmp_path, text))
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_site_file_is_read_with_its_paths_under_its_folder(tmp_path: Path) -> None:
    site = load_site(write_site(tmp_path))
    assert [node.name for node in site.with_role(Role.GPU)] == ["gpu-2", "gpu-3"]
    assert site.secrets == tmp_path.resolve() / "secrets"
    assert site.stack.files == (tmp_path.resolve() / "stack.yml",)
    assert site.hub.url == "https://hub.example.org:8443/"
    assert site.images.reference(site.images.hub) == "registry.example.org:5000/swarm-gpu-hub:1.2.3"
    assert site.storage.options["type"] == "nfs"


def test_defaults_run_this_release(tmp_path: Path) -> None:
    text = SITE.replace('registry = "registry.example.org:5000"\ntag = "1.2.3"\n', "")
    site = load_site(write_site(tmp_path, text))
    assert site.images.reference(site.images.allocator) == f"swarm-gpu:{__version__}"
    assert site.images.reference("quay.io/jupyter/base:2024") == "quay.io/jupyter/base:2024"


def test_an_unknown_key_names_file_line_key_and_the_nearest(tmp_path: Path) -> None:
    text = SITE.replace("https_port", "http_prot")
    message = error_of(tmp_path, text)
    assert message == (f"{tmp_path / 'site.toml'}:{line_of(text, 'http_prot')}: hub.http_prot: "
                       "unknown key; did you mean http_port?")


def test_a_typo_in_the_second_node_names_its_own_line(tmp_path: Path) -> None:
    text = SITE.replace('address = "10.0.0.12"\nroles', 'address = "10.0.0.12"\nrolse')
    message = error_of(tmp_path, text)
    where = f"{tmp_path / 'site.toml'}:{line_of(text, 'rolse')}"
    # Said once: the missing `roles` is what the unknown key meant.
    assert message == f"{where}: nodes.1.rolse: unknown key; did you mean roles?"


def test_a_missing_key_names_its_own_table(tmp_path: Path) -> None:
    text = SITE.replace('address = "10.0.0.12"\nroles = ["allocator", "gpu"]\n',
                        'address = "10.0.0.12"\n')
    # The missing key's place is its table's: the second [[nodes]], not the first.
    second = line_of(text, "[[nodes]]", 'name = "gpu-1"')
    assert error_of(tmp_path, text) == \
        f"{tmp_path / 'site.toml'}:{second}: nodes.1.roles: Field required"


def test_a_value_of_the_wrong_type_is_refused_not_converted(tmp_path: Path) -> None:
    text = SITE.replace("https_port = 8443", 'https_port = "8443"')
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'site.toml'}:{line_of(text, 'https_port')}: "
                              "hub.https_port: ")
    assert "(got '8443')" in message


@pytest.mark.parametrize("change, said", [
    (('roles = ["manager", "hub", "broker"]', 'roles = ["manager", "broker"]'),
     "no node has the role 'hub'"),
    (('roles = ["manager", "hub", "broker"]', 'roles = ["hub", "broker"]'),
     "a hub node must be a manager too: gpu-1"),
    (('name = "gpu-3"', 'name = "gpu-2"'), "named twice: gpu-2"),
    (('address = "10.0.0.13"', 'address = "gpu-3.lab"'), "nodes.2.address: Value error, not "
     "an IP address"),
    (('roles = ["allocator", "gpu"]', 'roles = ["allocator", "gpus"]'), "nodes.1.roles.1: "),
    (('name = "lab"', 'name = "Lab Stack"'), "stack.name: Value error, not a stack name"),
    (('files = ["stack.yml"]', 'files = ["stack.yml"]\nenv = { "NOT A NAME" = "x" }'),
     'stack.env."NOT A NAME": String should match pattern'),
])
def test_what_the_site_cannot_be(tmp_path: Path, change: tuple[str, str], said: str) -> None:
    assert said in error_of(tmp_path, SITE.replace(*change, 1))


def test_not_toml_is_one_line(tmp_path: Path) -> None:
    assert "not valid TOML" in error_of(tmp_path, "[hub\n")


def test_check_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_site(tmp_path)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "node gpu-2 (10.0.0.12): allocator, gpu" in out
    assert "users' volumes: driver local (device=:/export/home, o=addr=10.0.0.5,rw, type=nfs)" \
        in out
    assert out.endswith(f"{path}: ok\n")
    assert summary(load_site(path))[0].startswith("stack lab: ")


def test_check_of_a_bad_file_is_one_line_and_status_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = SITE.replace("domain", "domian")
    path = write_site(tmp_path, text)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("swarm-gpu check: ")
    assert f"{path}:{line_of(text, 'domian')}: hub.domian: unknown key; did you mean domain?" \
        in err


def test_the_install_guides_example_is_a_site_and_its_typo_line_is_what_check_says(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "install.md").read_text()
    example = guide.split("```toml\n", 1)[1].split("```", 1)[0]
    assert main(["check", str(write_site(tmp_path, example))]) == 0
    said = guide.split("```text\n", 1)[1].split("```", 1)[0].strip()
    capsys.readouterr()
    typo = write_site(tmp_path, example.replace("domain =", "domian =", 1))
    assert main(["check", str(typo)]) == 1
    assert capsys.readouterr().err.strip() == said.replace("site.toml", str(typo), 1)
