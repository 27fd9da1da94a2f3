"""``lmtier serve``: the shared cache server, its flags turned into a server config.

Every flag is an override of the config file's ``server:`` section (``None`` where not
given, so the file or the default stands); the config's loader, not this module, decides
the defaults and checks the values.

    add_serve(subparsers)  the command and its flags
    cmd_serve(args)        load the server config and serve until stopped
"""

from __future__ import annotations

import argparse

from lmtier.cli.args import require


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    require("server", "grpc", "google.protobuf")
    from lmtier.config.loading import load_server_config
    from lmtier.config.tokens import parse_token
    from lmtier.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.token:
        logging.getLogger("lmtier").warning(
            "--token puts a secret in the command line, which every local user can read (/proc/PID/cmdline): "
            "use --token-file or LMTIER_SERVER_TOKENS"
        )
    flags = {
        "host": args.host,
        "port": args.port,
        "tiers": tuple(args.tier) if args.tier else None,
        "tokens": tuple(parse_token(t) for t in args.token) if args.token else None,
        "token_file": args.token_file,
        "peer_token_file": args.peer_token_file,
        "peer_index": args.peer_index,
        "advertise": args.advertise,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "tls_client_ca": args.tls_client_ca,
        "tls_identity": args.tls_identity,
        "operators": tuple(args.operator) if args.operator else None,
        "stall_timeout": args.stall_timeout,
        "call_timeout": args.call_timeout,
        "max_chunk_bytes": args.max_chunk,
        "max_message_bytes": args.max_message,
        "max_keys": args.max_keys,
        "workers": args.workers,
        "max_concurrent_rpcs": args.max_concurrent_rpcs,
        "max_calls_per_tenant": args.max_calls_per_tenant,
        "max_call_rate_per_tenant": args.max_call_rate_per_tenant,
        "max_streams_per_connection": args.max_streams_per_connection,
        "metrics": False if args.no_metrics else None,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "shm_dir": "" if args.no_shm else args.shm_dir,
        "data_channel": False if args.no_data_channel else None,
        "data_port": args.data_port,
        "grace": args.grace,
    }
    config = load_server_config(args.config, **flags)
    return serve(config)


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the shared cache server (gRPC), for engines' grpc:// tiers")
    p.add_argument("--config", help="a YAML / TOML / JSON config file (its server: section); flags override it")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, help="port (default 50051; 0 picks a free one)")
    p.add_argument(
        "--tier",
        action="append",
        help="tier URL, fastest first, repeatable (default: cpu://?size=1GiB and "
        "file://~/.cache/lmtier/server?size=10GiB)",
    )
    p.add_argument("--token", action="append", help="SECRET[=TENANT]: a bearer token and its tenant (repeatable)")
    p.add_argument("--token-file", action="append", help="a file of SECRET=TENANT lines (repeatable)")
    p.add_argument(
        "--peer-token-file",
        action="append",
        help="a file of SECRET=TENANT lines: other instances' read-only tokens (repeatable)",
    )
    p.add_argument("--peer-index", help="the fleet's Redis, where this server announces what it holds to peers")
    p.add_argument("--advertise", help="host:port other instances reach this server at (with --peer-index)")
    p.add_argument("--tls-cert", help="server certificate (PEM): turns TLS on")
    p.add_argument("--tls-key", help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", help="CA that signs client certificates: turns mutual TLS on")
    p.add_argument(
        "--metrics-port", type=int, help="serve /metrics, /healthz and /readyz on this port (default: --port + 2)"
    )
    p.add_argument("--no-metrics", action="store_true", help="serve no /metrics, /healthz or /readyz")
    p.add_argument("--metrics-host", help="the metrics port's address (default: the gRPC address, --host)")
    p.add_argument("--max-chunk", help="largest chunk frame accepted (default 64MiB)")
    p.add_argument("--max-message", help="largest gRPC message accepted (default 16MiB; a client's pieces are 4MiB)")
    p.add_argument("--max-keys", type=int, help="keys per request (default 4096)")
    p.add_argument("--workers", type=int, help="threads serving calls (default 16)")
    p.add_argument("--max-concurrent-rpcs", type=int, help="calls at once; more are refused (default 64)")
    p.add_argument(
        "--max-calls-per-tenant",
        type=int,
        help="calls of one tenant at once; more are refused (default: half the workers when several tenants "
        "share the server, all of them for one)",
    )
    p.add_argument(
        "--tls-identity",
        choices=["auto", "cn", "uri", "dns"],
        help="what names a mutual-TLS client's tenant (default auto: common name, else URI, else DNS name)",
    )
    p.add_argument("--operator", action="append", help="a tenant that sees the whole server in stats (repeatable)")
    p.add_argument(
        "--max-call-rate-per-tenant", type=float, help="calls one tenant may start per second (default 0: no limit)"
    )
    p.add_argument("--stall-timeout", type=float, help="seconds a call may wait on its client (default 10)")
    p.add_argument("--call-timeout", type=float, help="seconds any call may run (default 300)")
    p.add_argument(
        "--max-streams-per-connection", type=int, help="streams of one connection at once; more wait (default 16)"
    )
    p.add_argument("--shm-dir", help="where same-host clients' segments live (default /dev/shm)")
    p.add_argument("--no-shm", action="store_true", help="refuse the shared-memory data plane")
    p.add_argument(
        "--data-port", type=int, help="the bulk data channel's port, for other hosts' loads (default: --port + 1)"
    )
    p.add_argument("--no-data-channel", action="store_true", help="serve other hosts' loads through gRPC alone")
    p.add_argument("--grace", type=float, help="seconds in-flight calls get on shutdown (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
