"""What the tests share: the services they run on, ports, faults, the hub's harness."""
