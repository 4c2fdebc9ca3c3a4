# RabbitMQ from Debian's rabbitmq-server package, for a site that pulls no public image
# (scripts/cluster builds it; elsewhere compose/stack.yml uses rabbitmq:3.10-management).
# Behaves as the official image where the stack relies on it: uid/gid 999 (the definitions
# secret is mounted for them), the management plugin on, the log on the console, data in
# /var/lib/rabbitmq, extra configuration from /etc/rabbitmq/conf.d.
ARG DEBIAN_BASE=debian:bookworm-slim
FROM ${DEBIAN_BASE}

# policy-rc.d: the package's postinst must not try to start the broker during the build.
RUN printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && groupadd --system --gid 999 rabbitmq \
    && useradd --system --uid 999 --gid 999 --home-dir /var/lib/rabbitmq \
        --shell /bin/false rabbitmq \
    && apt-get update \
    && apt-get install -y --no-install-recommends rabbitmq-server \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && rabbitmq-plugins enable --offline rabbitmq_management \
    && mkdir -p /etc/rabbitmq/conf.d /var/lib/rabbitmq \
    && chown -R rabbitmq:rabbitmq /etc/rabbitmq /var/lib/rabbitmq

# Debian's /usr/sbin wrapper writes the log to /var/log/rabbitmq; the server itself logs to
# the console with RABBITMQ_LOGS=-, where `docker service logs` reads it.
ENV RABBITMQ_LOGS=- HOME=/var/lib/rabbitmq
# The server's own scripts first on PATH, as in the official image (Debian's /usr/sbin
# wrappers would send rabbitmq-server's output to /var/log/rabbitmq): `rabbitmq-server` in a
# start script (compose/rabbitmq-cluster-node.sh) and the CLI tools run them directly.
ENV PATH=/usr/lib/rabbitmq/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER rabbitmq
WORKDIR /var/lib/rabbitmq
EXPOSE 5672 15672
CMD ["/usr/lib/rabbitmq/bin/rabbitmq-server"]
