"""flake.nix: it parses, it evaluates (against a stub nixpkgs: the real one cannot be fetched here),
and it lists the same Python dependencies as pyproject.toml.

Nix comes from `apt-get install -y nix-bin`; the tests that run it skip when it is absent.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLAKE = ROOT / "flake.nix"
SYSTEMS = ["x86_64-linux", "aarch64-linux", "x86_64-darwin", "aarch64-darwin"]
NIX_FLAGS = [
    "--extra-experimental-features",
    "nix-command flakes",
    "--option",
    "flake-registry",
    "",
    "--option",
    "substituters",
    "",
]

# Just enough of nixpkgs for the flake to evaluate offline: every attribute it uses, as fake derivations.
STUB_NIXPKGS = """
{
  outputs = { self }:
    let
      systems = [ %(systems)s ];
      genAttrs = names: f: builtins.listToAttrs (map (n: { name = n; value = f n; }) names);
      fake = name: { inherit name; pname = name; type = "derivation"; outPath = "/nix/store/fake-${name}"; };
      pythonNames = [ %(python)s "setuptools" "wheel" ];
      mkPkgs = system:
        let ps = genAttrs pythonNames fake // { buildPythonPackage = args: fake args.pname // { inherit args; }; };
        in genAttrs [ "ruff" "uv" "git" "jq" "skopeo" "umoci" "slurm" "openssh" "nixpkgs-fmt" ] fake // {
          inherit system;
          python311Packages = ps;
          python311 = { withPackages = f: fake "python3-env" // { deps = map (d: d.pname) (f ps); }; };
          mkShell = args: fake "shell" // { inherit args; };
          stdenv.isLinux = true;
        };
    in {
      lib = { inherit genAttrs; cleanSource = p: p; optionals = c: l: if c then l else [ ]; licenses.asl20 = "asl20"; };
      legacyPackages = genAttrs systems mkPkgs;
    };
}
"""


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> list[str]:
    return [re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-") for r in requirements]


def flake_list(name: str) -> list[str]:
    """The attribute names in `NAME = ps: with ps; [ ... ];` of flake.nix."""
    match = re.search(rf"{name} = ps: with ps; \[(.*?)\];", FLAKE.read_text(), re.S)
    assert match, f"flake.nix has no `{name} = ps: with ps; [ … ];`"
    return match.group(1).split()


def test_flake_parses():
    nix_instantiate = shutil.which("nix-instantiate")
    if nix_instantiate is None:
        pytest.skip("nix-instantiate is not installed (apt-get install -y nix-bin)")
    done = subprocess.run(
        [nix_instantiate, "--parse", str(FLAKE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_flake_lists_the_pyproject_dependencies():
    project = pyproject()["project"]
    assert sorted(flake_list("runtimeDeps")) == sorted(requirement_names(project["dependencies"]))
    assert sorted(flake_list("testDeps")) == sorted(
        n
        for n in requirement_names(project["optional-dependencies"]["test"])
        # ruff: a tool; verifiers, kubernetes-validate: not in nixpkgs (their tests skip without them)
        if n not in ("ruff", "verifiers", "kubernetes-validate")
    )
    assert f'version = "{project["version"]}";' in FLAKE.read_text()


def test_flake_evaluates_against_a_stub_nixpkgs(tmp_path: Path):
    nix = shutil.which("nix")
    if nix is None:
        pytest.skip("nix is not installed (apt-get install -y nix-bin)")
    stub, flake_dir = tmp_path / "nixpkgs", tmp_path / "project"
    stub.mkdir()
    flake_dir.mkdir()
    python_names = flake_list("runtimeDeps") + flake_list("testDeps")
    (stub / "flake.nix").write_text(
        STUB_NIXPKGS
        % {"systems": " ".join(f'"{s}"' for s in SYSTEMS), "python": " ".join(f'"{n}"' for n in python_names)}
    )
    shutil.copy(FLAKE, flake_dir / "flake.nix")

    def evaluate(attribute: str, apply: str):
        done = subprocess.run(
            [
                nix,
                *NIX_FLAGS,
                "eval",
                "--json",
                "--no-write-lock-file",
                "--override-input",
                "nixpkgs",
                f"path:{stub}",
                f"path:{flake_dir}#{attribute}",
                "--apply",
                apply,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    for output in ("packages", "devShells", "apps", "checks", "formatter"):
        assert sorted(evaluate(output, "builtins.attrNames")) == sorted(SYSTEMS), output

    package = evaluate(
        "packages.x86_64-linux.default",
        "p: { inherit (p.args) pname version pyproject pythonImportsCheck; "
        "deps = map (d: d.pname) p.args.dependencies; }",
    )
    assert package["pname"] == "primebuild" and package["pyproject"] is True
    assert package["deps"] == flake_list("runtimeDeps")
    assert "primebuild.builders.store" in package["pythonImportsCheck"]

    shell = evaluate("devShells.x86_64-linux.default", "s: map (p: p.name) s.args.packages")
    assert {"python3-env", "ruff", "skopeo", "umoci"} <= set(shell)
    app = evaluate("apps.x86_64-linux.default", "a: a")
    assert app == {"type": "app", "program": "/nix/store/fake-primebuild/bin/primebuild"}
