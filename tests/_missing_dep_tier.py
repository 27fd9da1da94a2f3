"""A tier module whose dependency is not installed, for the registry's install hint."""

import no_such_dependency_for_tests  # noqa: F401
