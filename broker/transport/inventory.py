"""What is on a RabbitMQ broker, read with ``rabbitmqctl`` (CtlInventory) or the management HTTP API
(HttpInventory): users with their tags, a vhost's tags, permissions, queues and exchanges. Deprovisioning
reads it to delete only what provisioning made (broker.transport.deprovision)."""

from __future__ import annotations

from typing import Protocol
from urllib.parse import quote

from fedmq.broker.transport.admin import Admin, CtlAdmin, HttpAdmin, http_tags, tag_list
from fedmq.broker.transport.errors import BrokerError


class Inventory(Protocol):
    """What deprovisioning needs to see and delete beyond admin.Admin."""

    def user_tags(self) -> dict[str, list[str]]:
        """Every user with its tags."""

    def vhost_tags(self, vhost: str) -> list[str] | None:
        """The vhost's tags; None when there is no such vhost."""

    def vhost_users(self, vhost: str) -> list[str] | None:
        """The users with permissions in ``vhost``; None when there is no such vhost."""

    def vhost_queues(self, vhost: str) -> list[str]: ...
    def vhost_exchanges(self, vhost: str) -> list[str]: ...
    def delete_queue(self, vhost: str, name: str) -> None: ...


class CtlInventory:
    def __init__(self, admin: CtlAdmin) -> None:
        self.admin = admin

    def _rows(self, *args: str, ok_text: str = "") -> list[list[str]]:
        out = self.admin.run(*args, "--quiet", "--no-table-headers", ok_text=ok_text)
        return [line.split("\t") for line in out.splitlines() if line.strip()]

    def user_tags(self) -> dict[str, list[str]]:
        return {row[0]: tag_list(row[1] if len(row) > 1 else "") for row in self._rows("list_users")}

    def vhost_tags(self, vhost: str) -> list[str] | None:
        rows = {row[0]: row[1:] for row in self._rows("list_vhosts", "name", "tags")}
        return None if vhost not in rows else tag_list(rows[vhost][0] if rows[vhost] else "")

    def vhost_users(self, vhost: str) -> list[str] | None:
        # one command for both: list_permissions fails on a vhost that does not exist (each rabbitmqctl
        # command starts an Erlang VM)
        gone = f"Virtual host '{vhost}' does not exist"
        rows = self._rows("list_permissions", "-p", vhost, ok_text=gone)
        return None if any(gone in "\t".join(row) for row in rows) else [row[0] for row in rows]

    def vhost_queues(self, vhost: str) -> list[str]:
        return [row[0] for row in self._rows("list_queues", "-p", vhost, "name")]

    def vhost_exchanges(self, vhost: str) -> list[str]:
        return [row[0] for row in self._rows("list_exchanges", "-p", vhost, "name") if row[0].strip()]

    def delete_queue(self, vhost: str, name: str) -> None:
        self.admin.run("delete_queue", "-p", vhost, name, ok_text="not found")


class HttpInventory:
    def __init__(self, admin: HttpAdmin) -> None:
        self.admin = admin

    def _names(self, path: str, key: str) -> list[str]:
        rows = self.admin.call("GET", path, ok=(404,)) or []
        return [str(row[key]) for row in rows if isinstance(row, dict) and key in row]

    def user_tags(self) -> dict[str, list[str]]:
        rows = self.admin.call("GET", "/api/users") or []
        return {str(r["name"]): http_tags(r.get("tags")) for r in rows if isinstance(r, dict) and "name" in r}

    def vhost_tags(self, vhost: str) -> list[str] | None:
        row = self.admin.call("GET", f"/api/vhosts/{quote(vhost, safe='')}", ok=(404,))
        return None if not isinstance(row, dict) else http_tags(row.get("tags"))

    def vhost_users(self, vhost: str) -> list[str] | None:
        rows = self.admin.call("GET", f"/api/vhosts/{quote(vhost, safe='')}/permissions", ok=(404,))
        return None if rows is None else [str(r["user"]) for r in rows if isinstance(r, dict) and "user" in r]

    def vhost_queues(self, vhost: str) -> list[str]:
        return self._names(f"/api/queues/{quote(vhost, safe='')}", "name")

    def vhost_exchanges(self, vhost: str) -> list[str]:
        return [n for n in self._names(f"/api/exchanges/{quote(vhost, safe='')}", "name") if n]

    def delete_queue(self, vhost: str, name: str) -> None:
        self.admin.call("DELETE", f"/api/queues/{quote(vhost, safe='')}/{quote(name, safe='')}", ok=(404,))


_METHODS = ("user_tags", "vhost_tags", "vhost_users", "vhost_queues", "vhost_exchanges", "delete_queue")


def inventory_for(admin: Admin) -> Inventory:
    if isinstance(admin, CtlAdmin):
        return CtlInventory(admin)
    if isinstance(admin, HttpAdmin):
        return HttpInventory(admin)
    if all(hasattr(admin, m) for m in _METHODS):
        return admin  # type: ignore[return-value]  # an admin that lists for itself (tests' doubles)
    raise BrokerError(f"cannot list users and queues with {type(admin).__name__}")
