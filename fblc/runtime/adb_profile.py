"""`fblc profile --device adb:SERIAL`: time fblc's cache benchmarks on a phone with the native runner.

The phone needs no Python: fblc pushes the runner (once; `.fblc-pushed` names the binary pushed) to
/data/local/tmp/fblc/+profile/ (a name no bundle folder takes: fblc replaces '+' in bundle names),
pushes the measurement plan (fblc/profiles/profiler.py) into runs/<id>/ below it, runs
`fblc-runner --profile` there over `adb shell` while streaming its progress lines, pulls the raw
results and removes runs/<id>/ again, whether the run succeeded or not. fblc then interprets the
results exactly as those of a local run. The runner is pushed to a staging name and renamed into
place, so a failed push leaves the previous runner or none, never half of one.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
import time
import uuid
from typing import Any, Callable, Mapping

from fblc import bundle_format as fmt
from fblc.runtime.adb import REMOTE_ROOT, STAMP, Adb, AdbError, Say, choose_runner, pushed_stamp, stream_runner
from fblc.runtime.native import RUNNER_NAME

PROFILE_DIR = f"{REMOTE_ROOT}/+profile"
PLAN, RESULTS = "plan.json", "profile-results.json"


def push_profiler(adb: Adb, serial: str, runner: str, say: Say = lambda line: None) -> str:
    """The runner in PROFILE_DIR on the device, pushed unless the one there is this binary; returns PROFILE_DIR."""
    stamp = fmt.sha256_of(runner)
    if pushed_stamp(adb, serial, PROFILE_DIR) == stamp:
        return PROFILE_DIR
    folder, staging = shlex.quote(PROFILE_DIR), f"{PROFILE_DIR}/.{RUNNER_NAME}.partial-{uuid.uuid4().hex[:8]}"
    # staging files of pushes that died with their device go first
    adb.shell(serial, f"mkdir -p {folder} && rm -f {folder}/.{RUNNER_NAME}.partial-*")
    try:
        adb.push(serial, [runner], staging, what="the runner")
        adb.shell(serial, f"chmod 755 {shlex.quote(staging)} && mv {shlex.quote(staging)} {folder}/{RUNNER_NAME} "
                          f"&& echo {stamp} > {folder}/{STAMP}")
    except BaseException:
        adb.remove(serial, staging)
        raise
    say(f"pushed the runner ({os.path.getsize(runner) / 1024:.0f} KiB) to {serial}:{PROFILE_DIR}")
    return PROFILE_DIR


def profile_on_device(adb: Adb, serial: str, plan: Mapping[str, Any], runner: str | None = None,
                      on_line: Callable[[dict[str, Any]], None] = lambda line: None,
                      say: Say = lambda line: None) -> dict[str, Any]:
    """Time `plan` on the device with the native runner's --profile mode; the raw results, as the runner wrote them."""
    remote = push_profiler(adb, serial, choose_runner(adb, serial, runner), say)
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    run_dir = f"runs/{run_id}"
    with tempfile.TemporaryDirectory(prefix="fblc-adb-profile-") as local:
        plan_path = os.path.join(local, PLAN)
        with open(plan_path, "w", encoding="utf-8") as handle:
            json.dump(plan, handle)
        adb.shell(serial, f"mkdir -p {shlex.quote(remote + '/' + run_dir)}")
        try:
            adb.push(serial, [plan_path], f"{remote}/{run_dir}/{PLAN}", what="the measurement plan")
            stream_runner(adb, serial, remote, f"--profile {run_dir}/{PLAN} --out {run_dir}/{RESULTS}", on_line)
            adb.pull(serial, [f"{remote}/{run_dir}/{RESULTS}"], local)
            try:
                with open(os.path.join(local, RESULTS), encoding="utf-8") as handle:
                    results = json.load(handle)
            except (OSError, ValueError) as error:
                raise AdbError(f"the profile results pulled from {serial} are unreadable ({error}); run "
                               "'fblc profile' again") from None
        finally:
            adb.remove(serial, f"{remote}/{run_dir}")
    results["backend"] = f"{results.get('backend', RUNNER_NAME)} over adb on {serial}"
    return results

