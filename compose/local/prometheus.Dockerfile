# Prometheus from Debian's prometheus package, for a site that pulls no public image
# (scripts/cluster up --monitoring builds it; elsewhere compose/stack.monitoring.yml uses the
# official prom/prometheus image). Behaves as the official image where the stack relies on
# it: the entrypoint is the prometheus binary (the stack gives every flag), it runs as nobody
# (65534), /prometheus is its data folder, owned by nobody (a new named volume copies that),
# and wget answers the stack's health check as busybox's does in the official image.
ARG DEBIAN_BASE=debian:bookworm-slim
FROM ${DEBIAN_BASE}

# policy-rc.d: the package's postinst must not try to start the server during the build.
RUN printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && mkdir -p /prometheus \
    && chown 65534:65534 /prometheus

USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
