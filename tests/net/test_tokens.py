"""The direct channel and the token path (pegaserve/net/) on 127.0.0.1, without Ray: a listener
serves only peers that present its token; an engine replica's `TokenRouter` sends each step's
outputs to the `TokenInbox` of the ingress that asked, which hands them to the call that carries
their tag, and the ingress's aborts travel back."""

from __future__ import annotations

import asyncio
import dataclasses

from pegaserve.messages import SampledToken, StepOutput
from pegaserve.net.channel import Listener, connect
from pegaserve.net.tokens import TokenInbox, TokenRouter
from pegaserve.stop import Length

HOST = "127.0.0.1"
WAIT_S = 10.0


def output(choice_id: str, token_id: int, finish=None) -> StepOutput:
    return StepOutput(choice_id, (SampledToken(token_id, -0.5),), finish)


def test_a_listener_serves_only_peers_with_its_token():
    async def main():
        frames = []

        async def echo(connection) -> None:
            while (frame := await connection.recv()) is not None:
                frames.append((connection.peer, frame))
                connection.send(frame)

        listener = Listener(echo, HOST)
        address = await listener.start()
        try:
            assert address.host == HOST and listener.serving
            stranger = await connect(dataclasses.replace(address, token="0" * len(address.token)), "stranger")
            stranger.send("let me in")
            assert await asyncio.wait_for(stranger.recv(), WAIT_S) is None  # refused: the connection ends
            friend = await connect(address, "friend")
            friend.send({"hello": [1, 2]})
            assert await asyncio.wait_for(friend.recv(), WAIT_S) == {"hello": [1, 2]}
            assert frames == [("friend", {"hello": [1, 2]})]
            friend.close()
        finally:
            listener.close()

    asyncio.run(main())


def test_step_outputs_reach_the_call_that_carries_their_tag_and_aborts_come_back():
    async def main():
        inbox = TokenInbox(HOST)
        address = await inbox.start()
        aborted: list[str] = []
        router = TokenRouter("decode#1", on_abort=aborted.append)
        queue: asyncio.Queue = asyncio.Queue()
        inbox.open(["a", "b"], queue, tag=7)
        done = router.route(["a", "b"], address, tag=7)
        router.on_step([output("a", 11), output("b", 21)])
        received = [await asyncio.wait_for(queue.get(), WAIT_S) for _ in range(2)]
        assert [(o.request_id, o.tokens[0].token_id) for o in received] == [("a", 11), ("b", 21)]
        assert inbox.sender_of("a") == "decode#1"
        inbox.open(["a"], queue, tag=8)  # "a" moved to another call: the old call's outputs are dropped
        inbox.abort("b")
        for _ in range(100):
            if aborted:
                break
            await asyncio.sleep(0.01)
        assert aborted == ["b"]
        router.on_step([output("a", 12, Length())])
        assert await asyncio.wait_for(done, WAIT_S) is None  # every choice finished or aborted
        await asyncio.sleep(0.05)
        assert queue.empty()

    asyncio.run(main())
