"""Take docs/chat-page.png: a real exchange with the demo model on the chat page at ``/``.

Serves models/qwen3.5-demo (K=2) on loopback, opens the page in headless Chromium (Debian's
chromium + chromium-driver, through selenium), sends one prompt greedily with thinking off, waits
for the reply and saves a screenshot (after one warm-up request, which pays the one-time start-up
costs).

    python scripts/experiments/chat_page_screenshot.py --out docs/chat-page.png
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "Write the function read_lines: Return a list of the lines in the file at path."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "qwen3.5-demo"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "chat-page.png"))
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--draft-tokens", type=int, default=2)
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--height", type=int, default=760)
    args = parser.parse_args()

    import httpx

    from engine.blas import use_fast_blas

    use_fast_blas()
    from browser import find_browser, start_chromium
    from fake_engine import LiveServer
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from engine.runtime import Engine
    from server.app import create_app
    from server.settings import ServerSettings

    found = find_browser()
    if isinstance(found, str):
        sys.exit(found)
    app = create_app(
        lambda: Engine.load(args.model, draft_tokens=args.draft_tokens),
        ServerSettings(model=args.model),
    )
    with LiveServer(app) as server:
        # The first request after start-up pays one-time warm-up; the screenshot shows the next.
        warm = {"model": app.state.mtp.names[0], "prompt": "def", "max_tokens": 8}
        httpx.post(server.url + "/v1/completions", json=warm, timeout=120).raise_for_status()
        driver = start_chromium(*found, width=args.width, height=args.height)
        try:
            driver.get(server.url + "/")
            WebDriverWait(driver, 30).until(
                lambda d: d.find_element(By.ID, "model").text not in ("", "…")
            )
            driver.find_element(By.ID, "settings-toggle").click()
            driver.find_element(By.ID, "temperature").send_keys("0")
            driver.find_element(By.ID, "max_tokens").clear()
            driver.find_element(By.ID, "max_tokens").send_keys("160")
            driver.find_element(By.ID, "settings-toggle").click()
            box = driver.find_element(By.ID, "prompt")
            box.send_keys(args.prompt)
            box.send_keys("\n")
            WebDriverWait(driver, 120).until(
                lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")
            )
            time.sleep(0.3)  # let the last animation frame paint
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(args.out)
            figures = driver.find_element(By.CSS_SELECTOR, ".msg.assistant .figures")
            print(figures.text.replace("\n", " "))
            print(
                "marked",
                figures.get_attribute("data-marked"),
                "usage.accepted",
                figures.get_attribute("data-usage-accepted"),
            )
        finally:
            driver.quit()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
