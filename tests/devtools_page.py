"""One page of a headless Chromium driven over the DevTools protocol, for what a dumped DOM cannot
show: text that appears only after a click (a popover, a drawer), and the text inside a sandboxed
frame (which runs in a process of its own).

The protocol goes over ``--remote-debugging-pipe`` (the browser reads commands on fd 3 and
answers on fd 4, NUL-terminated JSON), so no websocket client and no port are needed. Clicks are
mouse events at the element's centre, as a user's would be, not a scripted ``element.click()``.

Interface: ``DevToolsPage(browser, profile)`` as a context manager; ``open(url)``,
``wait_for_text(*needles)`` (the page's visible text once it holds every needle),
``wait_for_frame_text(*needles)``, ``wait_for_element(css)``, ``click_text(text)``, ``links()``,
``count(css)``, ``frame_texts()``, ``on_close(then)``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from pathlib import Path
from typing import Callable

__all__ = ["DevToolsPage"]

#: how long a page may take to show what a test waits for (seconds); the UI's first load is the slowest
WAIT_S = 60.0
#: how long one protocol command may take (seconds)
CALL_S = 30.0


class DevToolsPage:
    def __init__(self, browser: str, profile: Path, flags: tuple[str, ...], *, width: int = 1600, height: int = 2000):
        commands_read, self._commands = os.pipe()
        self._answers, answers_write = os.pipe()

        def onto_fds_3_and_4() -> None:  # in the child, before exec: where Chromium looks for the pipe
            os.dup2(commands_read, 3)
            os.dup2(answers_write, 4)

        self._proc = subprocess.Popen(
            [browser, *flags, f"--user-data-dir={profile}", "--remote-debugging-pipe",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=onto_fds_3_and_4, pass_fds=(3, 4))
        os.close(commands_read)
        os.close(answers_write)
        self._buffer = b""
        self._next_id = 0
        self._session: str | None = None
        self._on_close: list[Callable[[], object]] = []
        try:
            target = self._call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self._call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> DevToolsPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_close(self, then: Callable[[], object]) -> None:
        """Call ``then`` once the browser has exited (to remove its profile, say)."""
        self._on_close.append(then)

    def close(self) -> None:
        """Shut the browser down (its helper processes with it), then run the ``on_close`` calls."""
        try:  # an orderly shutdown: Chromium ends its helper processes before it exits
            self._call("Browser.close", session="")
        except (OSError, RuntimeError, TimeoutError):
            pass
        for fd in (self._commands, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self._proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for then in self._on_close:
            then()

    def _call(self, method: str, *, session: str | None = None, **params: object) -> dict:
        """Send one command (to ``session``, else the page's) and return its answer."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        session = self._session if session is None else session
        if session:  # none (or "") is the browser itself
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:  # events arrive between answers; only the answer to this call is kept
            while b"\0" not in self._buffer:
                if not select.select([self._answers], [], [], CALL_S)[0]:
                    raise TimeoutError(f"Chromium did not answer {method} within {CALL_S:.0f} s")
                chunk = os.read(self._answers, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe during {method}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def _evaluate(self, expression: str, session: str | None = None) -> object:
        result = self._call("Runtime.evaluate", session=session, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self._call("Page.navigate", url=url)

    def text(self) -> str:
        """The visible text of the page (``innerText``: what is laid out, not hidden markup)."""
        return self._evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, *needles: str, timeout: float = WAIT_S) -> str:
        """The page's visible text once it contains every needle; raises naming the missing ones."""
        return _until(lambda: [self.text()], needles, timeout, "the page")

    def wait_for_frame_text(self, *needles: str, timeout: float = WAIT_S) -> str:
        """The visible text of the first frame of ``frame_texts`` that contains every needle."""
        return _until(self.frame_texts, needles, timeout, "the page's separate frames")

    def click_text(self, text: str) -> None:
        """Press and release the mouse on the innermost visible element whose whole text is ``text``."""
        box = self._evaluate(f"""(() => {{
            const hits = [...document.querySelectorAll('body *')].filter(e =>
                e.textContent.trim() === {json.dumps(text)} && e.getClientRects().length);
            const el = hits[hits.length - 1];
            if (!el) return null;
            el.scrollIntoView({{block: 'center'}});
            const r = el.getBoundingClientRect();
            return {{x: r.left + r.width / 2, y: r.top + r.height / 2}};
        }})()""")
        if box is None:
            raise AssertionError(f"no visible element reads {text!r}; the page shows: {self.text()[:3000]}")
        for kind in ("mousePressed", "mouseReleased"):
            self._call("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def links(self) -> list[tuple[str, str]]:
        """(visible text, href) of every link on the page, as written in the markup."""
        return [tuple(pair) for pair in self._evaluate(
            "[...document.querySelectorAll('a[href]')].map(a => [a.innerText.trim(), a.getAttribute('href')])")]

    def count(self, css: str) -> int:
        """How many elements match the CSS selector ``css``."""
        return self._evaluate(f"document.querySelectorAll({json.dumps(css)}).length")

    def wait_for_element(self, css: str, timeout: float = WAIT_S) -> int:
        """How many elements match the CSS selector ``css``, once at least one does."""
        deadline = time.monotonic() + timeout
        while not (found := self.count(css)):
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout:.0f} s no element matches {css!r}; the page shows: "
                                     f"{self.text()[:3000]}")
            time.sleep(0.25)
        return found

    def frame_texts(self) -> list[str]:
        """The visible text of each frame the browser runs apart from the page: a sandboxed frame
        gets a process of its own, and the page's own scripts cannot read into it."""
        texts = []
        for target in self._call("Target.getTargets")["targetInfos"]:
            if target["type"] != "iframe":
                continue
            session = self._call("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]
            texts.append(self._evaluate("document.body ? document.body.innerText : ''", session=session) or "")
        return texts


def _until(read: Callable[[], list[str]], needles: tuple[str, ...], timeout: float, where: str) -> str:
    """The first text ``read`` returns that holds every needle, polled until ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        texts = read()
        for text in texts:
            if all(n in text for n in needles):
                return text
        if time.monotonic() > deadline:
            missing = [n for n in needles if not texts or n not in texts[0]]
            raise AssertionError(f"after {timeout:.0f} s {where} lacks {missing}; it shows: "
                                 f"{' | '.join(t[:3000] for t in texts) or '(nothing)'}")
        time.sleep(0.25)
