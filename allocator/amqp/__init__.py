"""The broker: its addresses, the RPC client, and how names are declared."""
