"""Two pretend hosts on one machine, each in a network namespace of its own, joined by a link that can be cut.

    with HostPair() as hosts:
        first = subprocess.Popen(hosts.run(0, ["paratrain", "run", "--master-addr", hosts.address(0), ...]))
        ...
        hosts.cut()          # the link goes down: nothing arrives, nothing is closed

Each namespace has its own loopback and one end of a veth pair, addressed in the
loopback range (127.0.1.1 and 127.0.1.2, with ``route_localnet`` so the kernel
routes them over the link). A process started in one reaches the other only over
that link, so cutting it (``ip link set ... down``) is what a pulled cable or a
dead switch port does to a host: its sockets stay open on both sides and simply
hear nothing. Shared memory does not go through the network: give both hosts a
backend that does (Gloo), or they still meet through /dev/shm.

It needs root and the ``ip`` command (as ``--link``, link.py).
"""
import os
import subprocess

from .link import tool

SUBNET = "127.0.1"


def check():
    """What stops a HostPair here, or None."""
    if os.geteuid() != 0 or tool("ip") is None:
        return "two pretend hosts in network namespaces need root and the ip command"
    return None


class HostPair:
    def __init__(self):
        tag = f"{os.getpid():x}"
        self.names = [f"pt{tag}h0", f"pt{tag}h1"]
        self.links = [f"pt{tag}l0", f"pt{tag}l1"]
        self.ip = tool("ip")

    def address(self, host):
        return f"{SUBNET}.{host + 1}"

    def run(self, host, cmd):
        """``cmd`` as a command line run inside host's namespace (GLOO_SOCKET_IFNAME is its link's end)."""
        return [self.ip, "netns", "exec", self.names[host], "env", f"GLOO_SOCKET_IFNAME={self.links[host]}", *cmd]

    def _ip(self, *args):
        subprocess.run([self.ip, *args], check=True, capture_output=True, text=True)

    def __enter__(self):
        try:
            for name in self.names:
                self._ip("netns", "add", name)
            self._ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for h, (name, link) in enumerate(zip(self.names, self.links)):
                self._ip("link", "set", link, "netns", name)
                self._ip("-n", name, "link", "set", "lo", "up")
                self._ip("-n", name, "addr", "add", f"{self.address(h)}/24", "dev", link)
                self._ip("-n", name, "link", "set", link, "up")
                for conf in ("all", link):   # 127/8 leaves the loopback device only with route_localnet
                    subprocess.run([self.ip, "netns", "exec", name, "sh", "-c",
                                    f"echo 1 > /proc/sys/net/ipv4/conf/{conf}/route_localnet"],
                                   check=True, capture_output=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def cut_command(self, host=1):
        """The command, run inside host's namespace, that cuts the link (a worker may run it)."""
        return [self.ip, "link", "set", self.links[host], "down"]

    def cut(self, host=1):
        """Take host's end of the link down: the two hosts hear nothing more of each other."""
        self._ip("-n", self.names[host], "link", "set", self.links[host], "down")

    def __exit__(self, *exc):
        for name in self.names:   # deleting a namespace deletes its end of the link, and the pair with it
            subprocess.run([self.ip, "netns", "del", name], capture_output=True)
