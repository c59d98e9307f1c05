"""Run each example notebook in JupyterLab in a real (headless) browser and save screenshots: a check for a person to
run before a release, not part of CI (it needs a browser and minutes of CPU).

Needs Debian's `chromium` and `chromium-driver` (`apt-get install -y chromium chromium-driver`; `playwright install`
downloads a browser and fails offline) and `pip install jupyterlab selenium`. JupyterLab listens on 127.0.0.1 with
no token, so run it only on a machine you trust. From the repository root:

    python tools/browser_smoke.py [--out benchmarks/results/notebook-screens] [01_pretrain 02_refinement ...]
    python tools/browser_smoke.py --opened      # only: which notebooks open marked modified (examples/ must not)

For each notebook: open it, note whether JupyterLab marked it modified on opening (see tools/nb_metadata.py), Run
All, take a screenshot of the live dashboard while it trains and of the plots at the end, and check that the
dashboard widget rendered and that no cell shows an error. The notebooks are not saved (nothing in examples/ changes
but examples/runs/)."""

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ["01_pretrain", "02_refinement", "03_sft"]

JS_STATE = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
if (!nb) return null;
const prompts = [...nb.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')].map(p => p.textContent.trim());
const outs = [...nb.querySelectorAll('.jp-OutputArea-output')];
return {
  prompts: prompts,
  errors: outs.filter(o => /Traceback \\(most recent call last\\)|^\\w*Error:/m.test(o.textContent)
                          || o.getAttribute('data-mime-type') === 'application/vnd.jupyter.error')
              .map(o => o.textContent.slice(0, 300)),
  widgets: nb.querySelectorAll('.jp-OutputArea-output .widget-output, .jp-OutputArea-output .widget-vbox').length,
  images: nb.querySelectorAll('.jp-OutputArea-output img').length,
  dirty: !!document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty'),
  busy: !!document.querySelector('.jp-Notebook-ExecutionIndicator[data-status="busy"]'),
};
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(port: int, root: Path) -> subprocess.Popen:
    "JupyterLab on 127.0.0.1 with no token, its app exposed to the page's scripts (to send Run All)."
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}"]
    cmd += ["--ServerApp.token=", "--ServerApp.password=", f"--ServerApp.root_dir={root}"]
    cmd += ["--LabApp.expose_app_in_browser=True", "--allow-root"]
    cmd += ["--ServerApp.disable_check_xsrf=True"]  # lets shutdown_kernels call the REST API without a browser cookie
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("JupyterLab did not start within a minute")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def wait(driver, cond, timeout: float, what: str, poll: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = driver.execute_script(JS_STATE)
        if st is not None and cond(st):
            return st
        time.sleep(poll)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s (last state {st})")


def smoke(driver, port: int, name: str, out: Path, timeout: float) -> dict:
    "Open, Run All, screenshot the dashboard while it trains and the plots at the end; the checks' findings."
    driver.get(f"http://127.0.0.1:{port}/lab/tree/{name}.ipynb?reset")
    wait(driver, lambda s: len(s["prompts"]) > 0, 90, f"{name}: the notebook did not open")
    time.sleep(3)  # let the kernel start and JupyterLab settle its metadata
    opened_dirty = driver.execute_script(JS_STATE)["dirty"]
    driver.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    t0 = time.time()
    st = wait(driver, lambda s: s["widgets"] > 0 or s["errors"], timeout, f"{name}: no dashboard widget appeared")
    widget_seen = st["widgets"] > 0
    if widget_seen:
        time.sleep(4)  # a few redraws
        w = driver.find_elements("css selector", ".jp-OutputArea-output .widget-vbox")
        if w:
            driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", w[0])
        driver.save_screenshot(str(out / f"{name}-dashboard.png"))
    st = wait(
        driver,
        lambda s: s["errors"] or all(p and "*" not in p for p in s["prompts"]),
        timeout,
        f"{name}: Run All did not finish",
        poll=1.0,
    )
    seconds = time.time() - t0
    imgs = driver.find_elements("css selector", ".jp-OutputArea-output img")
    if imgs:
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", imgs[-1])
        time.sleep(1)
    driver.save_screenshot(str(out / f"{name}-plots.png"))
    driver.execute_script("window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    return dict(
        notebook=name,
        opened_dirty=opened_dirty,
        widget_seen=widget_seen,
        errors=st["errors"],
        images=st["images"],
        run_all_s=round(seconds),
    )


JS_TAB = """
const tab = [...document.querySelectorAll('.lm-TabBar-tab.jp-mod-current')]
  .find(t => t.querySelector('.lm-TabBar-tabLabel')?.textContent === arguments[0]);
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
if (!tab || !nb || !nb.querySelector('.jp-Cell')) return null;
return tab.classList.contains('jp-mod-dirty');
"""


# A modified notebook would stop the next page load: JupyterLab asks to save on closing, the browser on leaving.
# Nothing is saved here, so its changes are dropped before it closes.
JS_DISCARD = """
for (const w of window.jupyterapp.shell.widgets('main')) { if (w.context) w.context.model.dirty = false; }
window.jupyterapp.commands.execute('docmanager:close-all-files');
"""


def shutdown_kernels(port: int, timeout: float = 120) -> None:
    "Stop every kernel the server runs (its REST API: no dialog to confirm) and wait until none is left."
    api, t0 = f"http://127.0.0.1:{port}/api/kernels", time.time()
    while kernels := json.loads(urllib.request.urlopen(api, timeout=10).read()):
        if time.time() - t0 > timeout:
            raise TimeoutError(f"kernels still running after {timeout:.0f} s: {[k['id'] for k in kernels]}")
        for k in kernels:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{api}/{k['id']}", method="DELETE"), timeout=10)
            except urllib.error.HTTPError as e:
                if e.code != 404:  # 404: closing its notebook already stopped it
                    raise
            except TimeoutError:  # a shutdown already under way (closing the notebook asked too): ask again
                pass
        time.sleep(0.5)


def opened_dirty(driver, port: int, path: str) -> bool:
    "Open a notebook (its kernel starts) and report whether JupyterLab marked its tab modified."
    driver.get(f"http://127.0.0.1:{port}/lab/tree/{path}?reset")  # reset: no tabs restored from an earlier visit
    name, t0 = Path(path).name, time.time()
    while driver.execute_script(JS_TAB, name) is None:
        if time.time() - t0 > 90:
            raise TimeoutError(f"{path}: the notebook did not open")
        time.sleep(0.5)
    time.sleep(4)  # let the kernel start and JupyterLab settle its metadata
    dirty = driver.execute_script(JS_TAB, name)
    driver.execute_script(JS_DISCARD)
    shutdown_kernels(port)
    return dirty


@contextmanager
def lab_session(root: Path):
    "(browser driver, port) of a JupyterLab serving `root`; both stopped on leaving."
    port = free_port()
    lab = start_lab(port, root)
    driver = None
    try:
        driver = browser()
        yield driver, port
    finally:
        if driver is not None:
            driver.quit()
        lab.terminate()
        lab.wait(30)


def check_opened() -> None:
    """Open every notebook once. Those in examples/ must open unmodified; those in nbs/ keep the display name
    `nbdev-clean` sets, which JupyterLab rewrites, so they are counted, not failed (see tools/nb_metadata.py)."""
    paths = [p.relative_to(ROOT) for d in ("nbs", "examples") for p in sorted((ROOT / d).glob("*.ipynb"))]
    dirty = []
    with lab_session(ROOT) as (driver, port):
        for p in paths:
            modified = opened_dirty(driver, port, str(p))
            dirty += [p] if modified else []
            print(f"{p}: opened {'modified' if modified else 'unmodified'}", flush=True)
    in_nbs = [str(p) for p in dirty if p.parts[0] == "nbs"]
    print(f"{len(in_nbs)} of {sum(p.parts[0] == 'nbs' for p in paths)} notebooks in nbs/ open marked modified")
    bad = [str(p) for p in dirty if p.parts[0] != "nbs"]
    if bad:
        sys.exit(f"example notebooks open marked modified: {bad}")
    print("every example notebook opens unmodified")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", default=NOTEBOOKS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/notebook-screens"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds for each notebook's Run All")
    ap.add_argument("--opened", action="store_true", help="only open every notebook and check which open modified")
    a = ap.parse_args()
    if a.opened:
        return check_opened()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    with lab_session(ROOT / "examples") as (driver, port):
        for name in a.notebooks:
            r = smoke(driver, port, name, out, a.timeout)
            print(r, flush=True)
            if not r["widget_seen"] or r["errors"] or not r["images"]:
                failed.append(name)
    if failed:
        sys.exit(f"browser smoke failed: {failed} (no dashboard widget, no image, or a cell shows an error)")
    print(f"browser smoke passed; screenshots in {out}")


if __name__ == "__main__":
    main()
