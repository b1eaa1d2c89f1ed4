# Sourced by scripts/lint_imports.sh and scripts/check.sh (not run on its own).
# Our sub-packages sit in root folders that setuptools' package-dir maps into one package
# (node/ -> swarmrl.node, ...), and the editable install finds them through an import hook that
# static tools (import-linter's grimp, mypy) don't run. So those tools read a tree of links laid
# out as the installed package is: DIR/swarmrl/{__init__.py,node,protocol,validator,simulations}.
# The folders must match [tool.setuptools.package-dir] in pyproject.toml.

# package_tree ROOT DIR: lay the links for the checkout at ROOT out under DIR (which must exist).
package_tree() {
  local root=$1 dir=$2 d
  mkdir -p "$dir/swarmrl"
  ln -sfn "$root/swarmrl/__init__.py" "$dir/swarmrl/__init__.py"
  for d in node protocol validator simulations; do ln -sfn "$root/$d" "$dir/swarmrl/$d"; done
}
