"""Netron shows fblc's pass dumps: the graph's op types, and a node's `fblc.layout` metadata in its side panel.

`--dump-dir DIR` writes DIR/NN_<pass>.onnx after every pass. This test builds the small MLP of
examples/mlp.py, dumps its passes with `fblc compile` (DUMP_PASS is a lowering pass, which `train-graph` does
not run), serves the dump of DUMP_PASS with the `netron` pip package on 127.0.0.1, opens it in headless
Chromium (Debian `chromium` + `chromium-driver`, driven by `selenium` through /usr/bin/chromedriver), waits
for the graph, checks the op types it draws, clicks a node and checks that "Node Properties" lists the node's
metadata_props entry `fblc.layout` under "Metadata", with the value the dump holds.

Missing tools (chromium, chromedriver, netron, selenium) skip these tests, except under FBLC_CI=1 (.ci/run),
where they must be there. The browser stays offline: every host but 127.0.0.1 fails to resolve, so Netron's
cookie-consent lookup (ipinfo.io) and its telemetry never leave the machine; the consent cookie is preset.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import Any

import onnx
import pytest

from fblc.cli import main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from mlp import build_mlp  # noqa: E402

DUMP_PASS = "rtile_select"          # the pass after which the dump carries `fblc.layout_note` node metadata
LAYOUT_KEY = "fblc.layout_note"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1200", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
RENDER_TIMEOUT_S = 20.0


def require(condition: bool, what: str) -> None:
    """Skip without `what`, but fail under FBLC_CI=1, where .ci/run installs everything."""
    if not condition:
        if os.environ.get("FBLC_CI") == "1":
            pytest.fail(f"{what} is missing (FBLC_CI=1: .ci/run should have installed it)")
        pytest.skip(f"{what} is missing")


def layout_dump(dump_dir: str) -> str:
    """The dump of DUMP_PASS in `dump_dir`."""
    matches = sorted(glob.glob(os.path.join(dump_dir, f"*_{DUMP_PASS}.onnx")))
    if not matches:
        dumps = [os.path.basename(d) for d in sorted(glob.glob(os.path.join(dump_dir, "*.onnx")))]
        pytest.fail(f"no dump *_{DUMP_PASS}.onnx in {dump_dir} (dumps: {dumps}); "
                    f"the {DUMP_PASS} pass should write {LAYOUT_KEY} node metadata")
    return matches[-1]


def node_layouts(model: onnx.ModelProto) -> dict[str, str]:
    """Node name -> its `fblc.layout_note` metadata, for the named nodes that have one."""
    layouts = {}
    for node in model.graph.node:
        for entry in node.metadata_props:
            if entry.key == LAYOUT_KEY and node.name:
                layouts[node.name] = entry.value
    return layouts


@pytest.fixture(scope="module")
def dump_path(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("netron-dump")
    model = build_mlp(str(work / "mlp.onnx"), batch=4, in_features=8, hidden=(16, 16), classes=3)
    dump_dir = str(work / "dumps")
    # `compile`, not `train-graph`: DUMP_PASS is a lowering pass, which only `compile` runs (after the
    # training passes that train-graph dumps too).
    assert main(["compile", model, "--target", "adreno830", "-o", str(work / "bundle"), "--dump-dir", dump_dir]) == 0
    return layout_dump(dump_dir)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through the system chromedriver (no Selenium Manager, no downloads)."""
    require(importlib.util.find_spec("selenium") is not None, "the selenium pip package")
    chromium = shutil.which("chromium")
    require(chromium is not None, "chromium (Debian package chromium)")
    driver_path = CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK) else shutil.which("chromedriver")
    require(driver_path is not None, "chromedriver (Debian package chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.set_page_load_timeout(RENDER_TIMEOUT_S)
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def netron_page(browser, dump_path) -> Iterator[Any]:
    """The dump served by Netron on a free 127.0.0.1 port, opened and rendered in `browser`."""
    require(importlib.util.find_spec("netron") is not None, "the netron pip package")
    import netron

    address = netron.start(dump_path, address=("127.0.0.1", 0), browse=False)   # port 0: a free port
    try:
        # Netron asks for cookie consent before it opens a model, unless this cookie is set.
        browser.execute_cdp_cmd("Network.setCookie", {"name": "consent", "value": str(int(time.time() * 1000)),
                                                      "domain": address[0], "path": "/"})
        browser.get(f"http://{address[0]}:{address[1]}/")
        wait_for_graph(browser)
        yield browser
    finally:
        netron.stop(address)


def wait_for_graph(driver: Any) -> None:
    """Wait until Netron shows the graph (body class `default`, node headers drawn); fail on its messages."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def ready(driver: Any) -> bool:
        body = set((driver.find_element(By.TAG_NAME, "body").get_attribute("class") or "").split())
        if body & {"notification", "alert"}:
            message = driver.find_element(By.ID, "message-text").get_attribute("textContent")
            if "cookies" in message:            # consent prompt despite the cookie: accept it
                driver.find_element(By.ID, "message-button").click()
                return False
            pytest.fail(f"Netron shows a message instead of the graph: {message!r}"
                        + (" (Netron refuses to run 180 days after its release: upgrade the netron package)"
                           if "update" in message.lower() else ""))
        return "default" in body and bool(driver.find_elements(By.CSS_SELECTOR, "g.node-item-type"))

    WebDriverWait(driver, RENDER_TIMEOUT_S, poll_frequency=0.1).until(
        ready, message=f"Netron did not render the graph within {RENDER_TIMEOUT_S:.0f} s")


# Each drawn node's header: <g class="node-item-type ..."><path/><text>OP_TYPE</text><title>NODE NAME</title></g>
HEADERS_JS = """
return Array.from(document.querySelectorAll('g.node-item-type')).map((g) => {
    const text = g.querySelector('text'), title = g.querySelector('title');
    return [text ? text.textContent : '', title ? title.textContent : ''];
});"""


def test_netron_draws_every_node_of_the_dump(netron_page, dump_path) -> None:
    model = onnx.load(dump_path)
    headers = netron_page.execute_script(HEADERS_JS)
    drawn_types = {op for op, _ in headers}
    assert {"Gemm", "MatMul", "Relu"} <= drawn_types
    assert drawn_types == {node.op_type for node in model.graph.node}
    assert sorted(name for _, name in headers) == sorted(node.name for node in model.graph.node)


def test_node_properties_show_fblc_layout(netron_page, dump_path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model = onnx.load(dump_path)
    layouts = node_layouts(model)
    assert layouts, f"{os.path.basename(dump_path)}: no named node has {LAYOUT_KEY} metadata"
    linear = [n.name for n in model.graph.node if n.name in layouts and n.op_type in ("Gemm", "MatMul")]
    name = (linear or list(layouts))[0]
    header = netron_page.execute_script(
        "return Array.from(document.querySelectorAll('g.node-item-type')).find((g) => "
        "g.querySelector('title') && g.querySelector('title').textContent === arguments[0]) || null;", name)
    assert header is not None, f"Netron drew no node named {name!r}"
    header.click()

    def properties(driver: Any) -> dict[str, str] | None:
        """The side panel's name -> value text once it shows this node's properties."""
        title = driver.find_element(By.ID, "sidebar-title").get_attribute("textContent")
        items = {}
        for item in driver.find_elements(By.CSS_SELECTOR, "#sidebar-content .sidebar-item"):
            key = item.find_element(By.CSS_SELECTOR, ".sidebar-item-name input").get_attribute("value")
            # The value's text lines; values over 80 characters also get a '+' expander, left out here.
            lines = item.find_elements(By.CSS_SELECTOR, ".sidebar-item-value-list .sidebar-item-value-line")
            items[key] = "\n".join(line.get_attribute("textContent") for line in lines)
        return items if title == "Node Properties" and items.get("name") == name else None

    items = WebDriverWait(netron_page, 10, poll_frequency=0.1).until(
        properties, message=f"Netron did not open the properties of node {name!r}")
    sections = [s.get_attribute("textContent") for s in netron_page.find_elements(
        By.CSS_SELECTOR, "#sidebar-content .sidebar-section")]
    assert "Metadata" in sections, sections
    assert items.get(LAYOUT_KEY) == layouts[name], f"node {name!r}: the panel shows {items}"
