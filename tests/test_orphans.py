"""A generation whose caller (an ingress replica) died is aborted on its replica (deployments/replica/orphans.py):
one watch per replica, one liveness question per distinct caller per round."""
import asyncio

from deployments.replica.orphans import OrphanWatch


def test_the_generations_of_a_dead_caller_are_aborted_and_the_others_run_on():
    asked, aborted = [], []
    dead = {"ingress-1"}

    def alive(caller):
        asked.append(caller)
        return caller not in dead

    async def abort(request_id):
        aborted.append(request_id)

    async def main():
        watch = OrphanWatch(abort, interval_s=0.01, alive=alive)
        for rid, caller in (("a", "ingress-1"), ("b", "ingress-1"), ("c", "ingress-2"), ("d", None)):
            watch.add(rid, caller)
        await asyncio.sleep(0.1)
        assert sorted(aborted) == ["a", "b"] and watch.aborted == 2 and set(watch.callers) == {"c"}
        watch.remove("c")
        await asyncio.sleep(0.05)
        assert watch._task.done()  # nothing in flight: the watch stops asking
    asyncio.run(main())
    rounds = asked.count("ingress-2")
    assert rounds >= 2 and asked.count("ingress-1") == 1  # once per caller and round, not once per request
