"""What the tests share: the services they run on, ports, faults, the hub's harness, and the
helpers and data of tests that more than one module uses, one module per concept. A test
module imports these, never another test module (tests/static/test_test_imports.py);
fixtures more than one module uses live in a ``conftest.py``."""
