"""The broker as shipped: permissions, limits, TLS, a broker cluster's log stream."""
