"""A Redis transaction sent now and its reply read later: the worker sends its start-of-job MULTI/EXEC
and reads the reply when the job ends, so the job starts without waiting a round trip (Redis runs the
transaction as it arrives, before any write the job or the worker sends later on another connection)."""

from __future__ import annotations

from redis.exceptions import ExecAbortError, ResponseError


class SentTransaction:
    """A pipeline's commands sent as one MULTI/EXEC on a connection of its own, the reply read later."""

    def __init__(self, pipe) -> None:
        self.pool = pipe.connection_pool
        commands = [args for args, _ in pipe.command_stack]
        self.count = len(commands)
        self.conn = self.pool.get_connection()
        try:
            self.conn.send_packed_command(self.conn.pack_commands([("MULTI",), *commands, ("EXEC",)]))
        except BaseException:
            self.drop()
            raise
        finally:
            pipe.reset()

    def settle(self) -> None:
        """Reads MULTI's OK, each command's QUEUED and EXEC's replies, as redis-py's Pipeline does; raises
        the first error among them."""
        try:
            first: Exception | None = None
            for _ in range(self.count + 1):
                try:
                    self.conn.read_response()
                except ResponseError as exc:  # a command Redis refused to queue: EXEC then aborts
                    first = first or exc
            try:
                replies = self.conn.read_response()
            except ExecAbortError:
                raise first or ResponseError("EXECABORT") from None
            if first is not None:
                raise first
            for reply in replies or ():
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            self.conn.disconnect()  # whatever is left unread goes with it
            raise
        finally:
            self.pool.release(self.conn)

    def drop(self) -> None:
        self.conn.disconnect()
        self.pool.release(self.conn)
