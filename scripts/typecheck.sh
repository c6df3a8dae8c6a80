#!/usr/bin/env bash
# mypy over the bottom layers ([tool.mypy] in pyproject.toml says which modules and how strictly).
#
# The repository's folders install as subpackages of fedmq (pyproject's package-dir: fedmq.broker -> broker/,
# ...), through an import hook that mypy cannot follow. So mypy runs in build/typecheck, a throwaway tree of
# symlinks laid out as the installed package: fedmq/{broker,aggregator,client_agent,cli,benchmarks} -> the
# folders, fedmq/*.py and its subpackages (tasks, privacy) -> fedmq/'s own. Its cache stays there too.
#
#   scripts/typecheck.sh            check; exit status 1 on findings
#   MYPY=path/to/mypy scripts/typecheck.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MYPY=${MYPY:-$ROOT/.venv/bin/mypy}
TREE=build/typecheck
mkdir -p "$TREE"
rm -rf "$TREE/fedmq"
mkdir "$TREE/fedmq"
for layer in broker aggregator client_agent cli benchmarks; do
  ln -s "../../../$layer" "$TREE/fedmq/$layer"
done
for f in fedmq/*.py $(dirname fedmq/*/__init__.py); do
  ln -s "../../../$f" "$TREE/fedmq/$(basename "$f")"
done
cd "$TREE"
exec "$MYPY" --config-file "$ROOT/pyproject.toml"
