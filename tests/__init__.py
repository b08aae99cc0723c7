"""dynvm's tests, a package: a helper module shared between folders is imported by its
package path (`from tests.vm._programs import build`, `from tests.jit import
_jit_helpers as h`), with no sys.path edits. pytest imports every test module as
`tests.<folder>.<module>` (rootdir on sys.path), so test file names may repeat across
folders. Helpers are `_`-prefixed modules, not conftest fixtures: import what you need.
"""
