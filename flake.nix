{
  description = "primebuild: declarative, reproducible asynchronous RL for LLMs";

  # Pinned by flake.lock once `nix flake lock` runs where nixpkgs can be fetched.
  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-unstable";

  outputs = { self, nixpkgs }:
    let
      lib = nixpkgs.lib;
      systems = [ "x86_64-linux" "aarch64-linux" "x86_64-darwin" "aarch64-darwin" ];
      forAllSystems = f: lib.genAttrs systems (system: f nixpkgs.legacyPackages.${system});
      version = "0.1.0"; # keep equal to [project] version in pyproject.toml

      # [project.dependencies] of pyproject.toml, by their nixpkgs attribute names (torchtitan, the trainer's
      # models, needs a nixpkgs that packages it, or an overlay).
      runtimeDeps = ps: with ps; [
        pydantic
        click
        rich
        jinja2
        pyyaml
        huggingface-hub
        safetensors
        transformers
        torch
        torchtitan
        triton
        fastapi
        uvicorn
        httpx
        matplotlib
        uv
        fabric
        python-debian
        pyzmq
        packaging
      ];
      # [project.optional-dependencies].test
      testDeps = ps: with ps; [ pytest pytest-timeout pytest-xdist hypothesis openai jsonschema wandb tensorboard peft ];

      primebuildFor = pkgs:
        let ps = pkgs.python311Packages;
        in ps.buildPythonPackage {
          pname = "primebuild";
          inherit version;
          pyproject = true;
          # A flake's ./. already holds only git-tracked files; cleanSource also drops editor leftovers.
          src = lib.cleanSource ./.;
          build-system = [ ps.setuptools ps.wheel ];
          dependencies = runtimeDeps ps;
          # pyproject pins torch==2.13.0 so that pip picks the CPU wheel; nixpkgs brings its own build.
          pythonRelaxDeps = [ "torch" "transformers" ];
          nativeCheckInputs = testDeps ps ++ [ pkgs.git ];
          # The unit tests run here; `cluster`, `gpu` and `slow` ones need machines a build sandbox lacks.
          pytestFlagsArray = [ "-m" "not cluster and not gpu and not slow" ];
          pythonImportsCheck = [ "primebuild" "primebuild.builders.store" "primebuild.builders.image" ];
          meta = {
            description = "Declarative, reproducible build-and-run system for asynchronous RL of LLMs";
            license = lib.licenses.asl20;
            mainProgram = "primebuild";
          };
        };
    in
    {
      packages = forAllSystems (pkgs: rec {
        primebuild = primebuildFor pkgs;
        default = primebuild;
      });

      apps = forAllSystems (pkgs: {
        default = {
          type = "app";
          program = "${self.packages.${pkgs.system}.primebuild}/bin/primebuild";
        };
      });

      devShells = forAllSystems (pkgs: {
        default = pkgs.mkShell {
          packages = [
            (pkgs.python311.withPackages (ps: runtimeDeps ps ++ testDeps ps ++ [ ps.setuptools ps.wheel ]))
            pkgs.ruff
            pkgs.uv
            pkgs.git
            pkgs.jq
          ] ++ lib.optionals pkgs.stdenv.isLinux [
            # What the `cluster` tests drive: OCI tools for `primebuild build`, Slurm and sshd targets.
            pkgs.skopeo
            pkgs.umoci
            pkgs.slurm
            pkgs.openssh
          ];
          # Install the package editable into a venv that sees the nix-provided packages, so the
          # `primebuild` command and its dependencies' entry points exist. The venv lives in the
          # user's cache, outside the repository.
          shellHook = ''
            venv="''${XDG_CACHE_HOME:-$HOME/.cache}/primebuild/nix-venv-$(basename "$(dirname "$(dirname "$(command -v python)")")")"
            if [ ! -x "$venv/bin/python" ]; then
              python -m venv --system-site-packages "$venv"
              "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e .
            fi
            source "$venv/bin/activate"
          '';
        };
      });

      checks = forAllSystems (pkgs: {
        primebuild = self.packages.${pkgs.system}.primebuild;
      });

      formatter = forAllSystems (pkgs: pkgs.nixpkgs-fmt);
    };
}
