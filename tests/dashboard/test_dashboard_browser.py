"""The dashboard's pages in a real headless browser (Debian's ``chromium`` driven by
Selenium through Debian's ``chromium-driver``): the group page renders owners and lag
from a live group and updates when a member leaves, the lag chart draws points, the
message browser shows a msgpack body.  Screenshots of the main pages are saved under
the test's tmp dir and, when ``METAQ_TEST_ARTIFACTS`` names a folder (``.ci/run``
passes ``tests/artifacts``, ignored by git), there too.

Skipped, saying what is missing, without chromium, chromedriver or selenium.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC, GROUP = "dash", "g"
CHROMIUM = next((p for p in (os.environ.get("METAQ_TEST_CHROMIUM"), "/usr/bin/chromium",
                             shutil.which("chromium"), shutil.which("chromium-browser"))
                 if p and os.path.exists(p)), None)
DRIVER = next((p for p in (os.environ.get("METAQ_TEST_CHROMEDRIVER"), "/usr/bin/chromedriver",
                           shutil.which("chromedriver")) if p and os.path.exists(p)), None)


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is not installed (the test extra)")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no headless browser: install Debian's chromium and chromium-driver "
                    f"(apt-get install chromium chromium-driver); chromium={CHROMIUM}, "
                    f"chromedriver={DRIVER}")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def _shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    # the whole page: as tall as its content
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(600, min(int(height) + 40, 4000)))
    assert driver.save_screenshot(str(path)), name
    assert path.stat().st_size > 1000
    out = os.environ.get("METAQ_TEST_ARTIFACTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)
    return path


def _cells(driver, css: str) -> list[str] | None:
    """The texts of the elements ``css`` finds; None when the page's own refresh (every
    second) replaced them while they were read (the caller's wait asks again)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        return [e.text for e in driver.find_elements(By.CSS_SELECTOR, css)]
    except StaleElementReferenceException:
        return None


def test_group_page_live_owners_lag_chart_and_a_member_leaving(cluster, members, dashboard,
                                                              browser, tmp_path):
    from selenium.webdriver.common.by import By

    one, two = members("one", "two")
    d = dashboard()
    wait_until(lambda: (c := d.request(f"/api/groups/{GROUP}"))[0] == 200 and len(
        [p for p in __import__("json").loads(c[2])["partitions"]
         if p["owner"] and p["lag_seconds"] is not None]) == 4,
        timeout=60, what="the group owned and sampled")
    browser.get(d.url + f"/groups/{GROUP}")
    owners = wait_until(lambda: (o := _cells(browser, "#partitions td .owner")) and
                        set(o) == {one.id, two.id} and o, timeout=30, what="owners shown")
    assert len(owners) == 4
    lags = wait_until(lambda: _cells(browser, "#partitions td .lag"), timeout=10,
                      what="the lag cells")
    assert all(int(x) > 0 for x in lags), lags
    assert wait_until(lambda: _cells(browser, "#group-status .state"), timeout=10,
                      what="the group state") == ["warn"]
    # the chart: points drawn by the page's own script as samples come in
    wait_until(lambda: len(browser.find_elements(
        By.CSS_SELECTOR, "#lag-chart circle.series-messages")) >= 3,
        timeout=30, what="three points on the lag chart")
    line = browser.find_element(By.CSS_SELECTOR, "#lag-chart polyline.series-messages")
    assert len(line.get_attribute("points").split()) >= 3
    _shot(browser, tmp_path, "dashboard-group")
    # a member leaves: the page (polling every second, no reload) follows
    browser.execute_script("document.body.dataset.marker = 'same page'")
    two.close()
    wait_until(lambda: _cells(browser, "#members td:first-child") == [one.id] and
               set(_cells(browser, "#partitions td .owner") or ()) == {one.id},
               timeout=60, what="the page to show one member owning everything")
    assert browser.execute_script("return document.body.dataset.marker") == "same page"
    # the other main pages
    browser.get(d.url + "/")
    assert _cells(browser, "#groups td:first-child") == [GROUP]
    assert len(_cells(browser, "#brokers tbody tr")) == 2
    _shot(browser, tmp_path, "dashboard-cluster")
    browser.get(d.url + f"/topics/{TOPIC}")
    assert len(_cells(browser, "#partitions tbody tr")) == 4
    _shot(browser, tmp_path, "dashboard-topic")
    # history (its ownership timeline), what-if, audit: drawn where the build has them,
    # "not available in this build" where it does not
    for view, mark in (("history", "#timeline"), ("what-if", "#what-if-summary"),
                       ("audit", "#audit-summary")):
        browser.get(d.url + f"/groups/{GROUP}/{view}")
        main = browser.find_element(By.TAG_NAME, "main").text
        assert "not available in this build" in main or \
            browser.find_elements(By.CSS_SELECTOR, mark), (view, main[:500])
        _shot(browser, tmp_path, f"dashboard-{view}")
    browser.get(d.url + "/brokers/0")
    assert _cells(browser, "table td:first-child")
    _shot(browser, tmp_path, "dashboard-broker")


def test_message_browser_shows_a_msgpack_body(cluster, dashboard, browser, tmp_path):
    from selenium.webdriver.common.by import By

    d = dashboard()
    browser.get(d.url + "/messages")
    form = browser.find_element(By.ID, "browse-form")
    form.find_element(By.NAME, "topic").send_keys(TOPIC)
    form.find_element(By.NAME, "partition").send_keys("0-0")
    form.find_element(By.NAME, "offset").send_keys("0")
    form.find_element(By.TAG_NAME, "button").click()
    rows = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#messages tbody tr"),
                      timeout=30, what="messages listed")
    api = d.json(f"/api/messages?topic={TOPIC}&partition=0-0&offset=0")
    assert len(rows) == len(api["messages"]) >= 2
    first = rows[0].find_elements(By.TAG_NAME, "td")
    assert first[0].text == "0" and first[4].text == "msgpack"
    assert '"who": "dashboard-test"' in first[5].text and '"n":' in first[5].text
    _shot(browser, tmp_path, "dashboard-messages")
    # without JavaScript the same page works: it is a plain GET form
    assert "offset=0" in browser.current_url
