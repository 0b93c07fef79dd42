"""``paratrain run --link RATE --nnodes N``: pretend hosts joined by a slow link, on one machine.

The launcher starts again inside a private network namespace (``unshare -n``)
whose loopback is rate-limited by a token bucket:

    tc qdisc add dev lo root tbf rate 1gbit burst 512kb latency 20ms

and runs all N x -n workers there as N pretend hosts (PARATRAIN_PRETEND_HOSTS):
shared memory inside each pretend host stays at full speed, while whatever
crosses between them (Gloo or ZeroMQ over 127.0.0.1, the rendezvous store)
meets a real bandwidth limit, as between machines. The namespace ends with
the job. It needs root (a network namespace and tc) and uses loopback only.
"""
import os
import re
import shutil

RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")
TOOLS = ("unshare", "ip", "tc")


def tool(name):
    """unshare, ip and tc, also where a PATH without sbin would not look."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")


def check(rate):
    """What stops --link RATE here, or None."""
    if not RATE.match(rate):
        return f"--link {rate!r}: give a rate as tc writes it, e.g. 100mbit, 1gbit, 10gbit"
    missing = [t for t in TOOLS if tool(t) is None]
    if os.geteuid() != 0 or missing:
        why = "it is not running as root" if os.geteuid() != 0 else f"{', '.join(missing)} not found"
        return (f"--link needs root and the unshare, ip and tc commands ({why}): it runs the job in a private "
                "network namespace (unshare -n) and limits that namespace's loopback with tc; run as root, "
                "or drop --link")
    return None


INSIDE = "--inside-link"   # a hidden flag: the launcher started in the namespace


def limited(rate, cmd):
    """``cmd`` run inside a fresh network namespace whose loopback carries ``rate``: one token
    bucket for every byte over it, both directions together (a half-duplex link)."""
    ip, tc = tool("ip"), tool("tc")
    setup = f'{ip} link set lo up && {tc} qdisc add dev lo root tbf rate "$0" burst 512kb latency 20ms && exec "$@"'
    return [tool("unshare"), "-n", "--", "sh", "-c", setup, rate, *cmd]


def command(rate, python, argv):
    """The launcher again, inside a fresh network namespace with a limited loopback."""
    return limited(rate, [python, "-m", "paratrain.run", INSIDE, *argv])


def as_pretend_hosts(args):
    """Inside: the --nnodes nodes become pretend hosts of this one launcher."""
    hosts = args.nnodes
    args.nproc, args.nnodes, args.node_rank = args.nproc * hosts, 1, 0
    os.environ["PARATRAIN_PRETEND_HOSTS"] = str(hosts)
