"""Helpers shared by the test modules (a test module never imports another): conftest.py puts
tests/ on sys.path, so they import as `from support.server_helpers import running_server`."""
