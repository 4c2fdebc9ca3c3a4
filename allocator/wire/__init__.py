"""The wire: what travels between the parts, and the rules both ends share."""
