"""Where the processes of a job run, and the addresses they reach each other by.

ps-lite needs two kinds of address: ``DMLC_PS_ROOT_URI``, the scheduler's
address as *every* process sees it, and each process's own
``DMLC_NODE_HOST``, the address the others connect back to (without it,
ps-lite takes the first non-loopback interface, or ``DMLC_INTERFACE``).
127.0.0.1 is only right when every process runs on this machine.
"""
import socket


class LaunchError(ValueError):
    """The job as described cannot be launched (a usage error: status 2)."""


def read_hostfile(path):
    """The hosts of a hostfile: one per line, ``host`` or ``host:slots``.

    ``#`` starts a comment; blank lines are skipped. ``host`` may be
    ``user@host`` or an ssh alias.

    Returns
    -------
    list of (str, int)
        Each host with its number of worker slots (default 1).
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LaunchError(f'cannot read hostfile {path}: {e.strerror or e}') from e
    return parse_hosts(lines, f'hostfile {path}')


def parse_hosts(lines, source):
    """``host[:slots]`` lines (a hostfile's, a discovery command's output)
    -> [(host, slots)]; `source` names them in errors."""
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        host, sep, slots = line.partition(':')
        host = host.strip()
        try:
            slots = int(slots) if sep else 1
        except ValueError:
            slots = 0
        if not host or slots < 1 or len(host.split()) != 1:
            raise LaunchError(f'{source}, line {number:d}: expected "host" or "host:slots" '
                              f'with slots >= 1, got {line!r}')
        hosts.append((host, slots))
    if not hosts:
        raise LaunchError(f'{source} names no host')
    return hosts


def place(hosts, num_workers, num_servers, strict=False):
    """Spread workers and servers over `hosts`.

    Workers fill each host's slots in hostfile order (the first two on a
    first host of 2 slots, ...); past the total of slots they go one more
    per host in turn, unless `strict`. Servers go one per host in turn, from the
    first; they take no slot.

    Returns
    -------
    (list of str, list of str)
        The host of each worker, of each server.
    """
    total = sum(slots for _, slots in hosts)
    if num_workers > total and strict:
        raise LaunchError(f'{num_workers:d} workers do not fit in the {total:d} slot(s) of the '
                          'hostfile (--strict-slots)')
    workers = [host for host, slots in hosts for _ in range(slots)][:num_workers]
    while len(workers) < num_workers:
        workers.append(hosts[(len(workers) - total) % len(hosts)][0])
    servers = [hosts[i % len(hosts)][0] for i in range(num_servers)]
    return workers, servers


def resolve(host):
    """The IPv4 address this machine resolves `host` (``user@`` allowed)
    to, or None."""
    name = host.rsplit('@', 1)[-1]
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    return infos[0][4][0] if infos else None


def is_loopback(address):
    return address.startswith('127.')


def outward_address(peer):
    """The address of this machine on the route to `peer` (an IPv4
    address), or None. A UDP connect only looks the route up: nothing is
    sent."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((peer, 9))
        return s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()


def addresses(hosts, scheduler_host, scheduler_address=None, interface=None,
              others_remote=False, resolver=None):
    """The scheduler's address and each host's ``DMLC_NODE_HOST``.

    Parameters
    ----------
    hosts : list of str
        Every host the job runs on, as this machine names them.
    scheduler_host : str
    scheduler_address : str, optional
        ``--scheduler-address``: used as given.
    interface : str, optional
        ``DMLC_INTERFACE``: then ps-lite finds each process's own address
        and no ``DMLC_NODE_HOST`` is set (except when all is local).
    others_remote : bool
        The job also runs on hosts not in `hosts` (SLURM: nodes this task
        does not look up), so it is not all local.
    resolver : callable, optional
        host -> IPv4 address or None (tests pass their own); default
        :func:`resolve`.

    Returns
    -------
    (str, dict)
        ``DMLC_PS_ROOT_URI``, and host -> ``DMLC_NODE_HOST`` (None: unset).
        A host that resolves to a loopback address is this machine.
    """
    resolver = resolver or resolve
    resolved = {h: resolver(h) for h in list(hosts) + [scheduler_host]}
    if not others_remote and all(a and is_loopback(a) for a in resolved.values()):
        return scheduler_address or '127.0.0.1', {h: '127.0.0.1' for h in resolved}
    peers = [a for a in resolved.values() if a and not is_loopback(a)]
    here = outward_address(peers[0]) if peers else None
    seen = {h: (here if a and is_loopback(a) else a) for h, a in resolved.items()}
    root = scheduler_address or seen[scheduler_host]
    if not root:
        raise LaunchError(f'cannot tell the address of scheduler host {scheduler_host} as the '
                          'other hosts see it: pass --scheduler-address')
    return root, {h: None if interface else seen[h] for h in resolved}


def predicted_ranks(nodes):
    """ps-lite's ranks of servers (or of workers) at (address, port): the scheduler
    sorts nodes by address, *descending* (its comparator, in van.cc), then
    by port; None when an address is unknown (ps-lite picks it)."""
    if any(addr is None for addr, _ in nodes):
        return None
    order = sorted(range(len(nodes)), key=lambda i: nodes[i][1])
    order.sort(key=lambda i: nodes[i][0], reverse=True)    # stable: ports stay ascending
    ranks = [0] * len(nodes)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks
