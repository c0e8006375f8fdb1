# Sourced by scripts/test.sh: a throwaway PostgreSQL cluster on loopback for the tests.
# Installs the server from the machine's package manager when missing, starts it on a
# free port as the postgres user, exports HEADRACE_TEST_POSTGRES (a URL) and stops and
# removes the cluster when the calling script exits.
pg_bin_dir() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}
if [ -z "$(pg_bin_dir)" ]; then
    if command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    else
        echo "PostgreSQL is missing and there is no apt-get to install it" >&2
        exit 1
    fi
fi
PG_BIN="$(pg_bin_dir)"
PG_DIR="$(mktemp -d /tmp/headrace-pg.XXXXXX)"
PG_PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
chmod 755 "$PG_DIR"
PG_RUN=()
if [ "$(id -u)" = 0 ]; then
    chown postgres "$PG_DIR"
    PG_RUN=(runuser -u postgres --)
fi
"${PG_RUN[@]}" "$PG_BIN/initdb" -D "$PG_DIR/data" -A trust -U postgres >/dev/null
# Trust on loopback: the tests log in as postgres; an unknown role is a refused login.
"${PG_RUN[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/log" -w \
    -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1" start >/dev/null
stop_postgres() {
    "${PG_RUN[@]}" "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
}
trap stop_postgres EXIT
export HEADRACE_TEST_POSTGRES="postgresql://postgres@127.0.0.1:$PG_PORT/postgres"
export HEADRACE_TEST_POSTGRES_BIN="$PG_BIN"
export HEADRACE_TEST_POSTGRES_DATA="$PG_DIR/data"
