"""The schema: one list of migrations both backends apply at open, and the version check."""

from __future__ import annotations

from control_plane.store.base import StoreError

# One list for both backends, append only: migration N (1-based) moves a database from schema
# version N-1 to N. The SQL is what SQLite and PostgreSQL both accept; `{auto_id}` is each one's
# auto-increment key (SQLite keeps the types it was given before: DOUBLE PRECISION has REAL
# affinity, BIGINT INTEGER's).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE regions (
            name TEXT PRIMARY KEY,
            lat DOUBLE PRECISION NOT NULL,
            lon DOUBLE PRECISION NOT NULL,
            ingress_url TEXT,
            weight DOUBLE PRECISION NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('active', 'draining', 'disabled')),
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            url TEXT NOT NULL,
            model TEXT NOT NULL,
            tp_size INTEGER NOT NULL,
            drain_requested INTEGER NOT NULL DEFAULT 0,
            registered_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE api_keys (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL,
            tenant TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            rpm BIGINT NOT NULL,
            tpm BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            revoked_at DOUBLE PRECISION
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        """CREATE TABLE audit_log (
            id {auto_id},
            at DOUBLE PRECISION NOT NULL,
            actor TEXT NOT NULL,
            client TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT NOT NULL,
            detail TEXT NOT NULL
        )""",
    ),
    (
        # The drain sequence of each draining node (control_plane/drain.py): survives restarts.
        """CREATE TABLE drains (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            reason TEXT NOT NULL,
            phase TEXT NOT NULL,
            started_at DOUBLE PRECISION NOT NULL,
            steps TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
        # DELETE /v1/regions/{name} drains the region's nodes first.
        "ALTER TABLE regions ADD COLUMN is_deleting INTEGER NOT NULL DEFAULT 0",
    ),
    (
        # Each node's own heartbeat credential (control_plane/node_credentials.py): the node id,
        # region and URL its beats may carry. `url` is NULL until the first beat binds it.
        """CREATE TABLE node_credentials (
            node_id TEXT PRIMARY KEY,
            region TEXT NOT NULL,
            url TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # The nodes that were beating, with their latest beat (control_plane/health_snapshot.py):
        # a restarted control plane keeps them healthy for a grace period.
        """CREATE TABLE node_health (
            node_id TEXT PRIMARY KEY,
            beat TEXT NOT NULL,
            seen_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # Which replica leads the work that runs once (control_plane/leader.py; PostgreSQL only).
        """CREATE TABLE leader_lease (
            one INTEGER PRIMARY KEY CHECK (one = 1),
            holder TEXT NOT NULL,
            epoch BIGINT NOT NULL,
            backend_pid BIGINT NOT NULL,
            renewed_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # What each replica's Envoys have ACKed of the drains in their `envoy` step
        # (control_plane/envoy_reports.py; PostgreSQL only).
        """CREATE TABLE xds_reports (
            replica_id TEXT PRIMARY KEY,
            report TEXT NOT NULL,
            reported_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # Gateway PoPs' limit shares (control_plane/limit_reports.py): each PoP's default share
        # and last report, and per key in use each PoP's share, demand and buckets' levels.
        """CREATE TABLE limit_pops (
            pop TEXT PRIMARY KEY,
            default_share DOUBLE PRECISION NOT NULL,
            reported_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE limit_shares (
            key_id TEXT NOT NULL,
            pop TEXT NOT NULL,
            share DOUBLE PRECISION NOT NULL,
            demand DOUBLE PRECISION NOT NULL,
            demand_at DOUBLE PRECISION NOT NULL,
            need DOUBLE PRECISION NOT NULL,
            need_at DOUBLE PRECISION NOT NULL,
            request_level DOUBLE PRECISION,
            token_level DOUBLE PRECISION,
            levels_at DOUBLE PRECISION,
            PRIMARY KEY (key_id, pop)
        )""",
    ),
    (
        # Envoys' xDS credentials (control_plane/xds/credentials.py): the role and region a
        # token's ADS streams may ask for (region NULL for the edge).
        """CREATE TABLE envoy_credentials (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL CHECK (role IN ('ingress', 'edge')),
            region TEXT,
            secret_sha256 TEXT NOT NULL UNIQUE,
            created_at DOUBLE PRECISION NOT NULL
        )""",
    ),
    (
        # Per-key model access and budgets (control_plane/keys.py): the models a key may use and
        # its limits per model (JSON; NULL: every model, no per-model limit), its token budget
        # per period; the tokens each key spent per model and period (control_plane/spend.py);
        # and the last spend batch applied per PoP (a report sent again counts once).
        "ALTER TABLE api_keys ADD COLUMN models TEXT",
        "ALTER TABLE api_keys ADD COLUMN model_limits TEXT",
        "ALTER TABLE api_keys ADD COLUMN max_budget_tokens BIGINT",
        "ALTER TABLE api_keys ADD COLUMN budget_period_s BIGINT",
        "ALTER TABLE limit_pops ADD COLUMN spend_batch TEXT",
        """CREATE TABLE key_spend (
            key_id TEXT NOT NULL,
            model TEXT NOT NULL,
            period_start BIGINT NOT NULL,
            tokens BIGINT NOT NULL,
            PRIMARY KEY (key_id, period_start, model)
        )""",
    ),
    (
        # A region's endpoint picker (region_picker/), "IP:PORT", set through the admin API: xDS
        # gives the region's ingress Envoys its ext_proc filter (control_plane/xds/picker.py).
        "ALTER TABLE regions ADD COLUMN picker TEXT",
    ),
    (
        # The last spend batch applied per gateway process of each PoP (control_plane/spend.py):
        # a PoP may run several, each sending its own unanswered batch again; the PoP-wide
        # column took another process's batch for a new one and counted a resent batch twice.
        """CREATE TABLE spend_reporters (
            pop TEXT NOT NULL,
            reporter TEXT NOT NULL,
            spend_batch TEXT NOT NULL,
            applied_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (pop, reporter)
        )""",
        "ALTER TABLE limit_pops DROP COLUMN spend_batch",
    ),
)


def migration_sql(statement: str, auto_id: str) -> str:
    return statement.replace("{auto_id}", auto_id)


def check_schema_version(version: int) -> None:
    if version > len(MIGRATIONS):
        raise StoreError(
            f"database schema v{version} is newer than this control plane "
            f"(knows up to v{len(MIGRATIONS)})"
        )
