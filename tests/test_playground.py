"""The playground page (GET / of `diversed serve`) in a real browser: Debian's Chromium, headless, driven by
Selenium through the system's chromedriver, against a server on the tiny models. Skipped, with the reason,
where no browser is installed (setup.sh installs one)."""

from __future__ import annotations

import shutil

import pytest
from serving import client, save_flat_head, serving, tiny_chat_pair

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no browser: Debian's chromium and chromium-driver are not installed "
                                       "(./setup.sh installs them with apt)")
ORIGIN_NAMES = {"kept", "relaxed", "correction", "bonus", "target"}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with serving(tiny_chat_pair(), heads={"flat": save_flat_head(tmp_path_factory.mktemp("head"))}) as (url, _):
        yield url


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1280,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, url):
    """The page, freshly loaded, with its dial built from the server's /v1/verification."""
    browser.set_window_size(1280, 1000)
    browser.get(url + "/")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#dials .rule option"))
    yield browser
    # Chromium logs every 4xx as an error: the server's refusals of bad input are expected, nothing else.
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE" and not (
        entry["source"] == "network" and "/v1/" in entry["message"] and "status of 400" in entry["message"])]
    assert not errors, f"console errors: {errors}"


def fill(driver, prompt: str, *, endpoint: str = "completion", max_tokens: int = 12, temperature: float = 0,
         seed: int = 0) -> None:
    driver.find_element(By.CSS_SELECTOR, f"input[name=endpoint][value={endpoint}]").click()
    for selector, value in (("#prompt", prompt), ("#max-tokens", max_tokens), ("#temperature", temperature),
                            ("#seed", seed)):
        box = driver.find_element(By.CSS_SELECTOR, selector)
        box.clear()
        box.send_keys(str(value))


def set_rule(driver, dial: str, rule: str, **values) -> None:
    node = driver.find_element(By.CSS_SELECTOR, f"[data-dial={dial}].dial")
    Select(node.find_element(By.CSS_SELECTOR, ".rule")).select_by_value(rule)
    for name, value in values.items():
        box = node.find_element(By.CSS_SELECTOR, f"input[data-parameter={name}]")
        box.clear()
        box.send_keys(str(value))


def generate(driver, answers: int = 1) -> list:
    """Click Generate and wait until every answer has its server figures (the usage chunk came) or an error."""
    driver.find_element(By.ID, "generate").click()

    def done(d):
        panels = d.find_elements(By.CSS_SELECTOR, "#answers .answer")
        finished = [p for p in panels if "server" in p.find_element(By.CSS_SELECTOR, ".tokens-per-s").text
                    or p.find_element(By.CSS_SELECTOR, ".error").is_displayed()]
        return panels if len(panels) == answers and len(finished) == answers else False

    return WebDriverWait(driver, 60).until(done)


def marks(panel) -> list[tuple[str, str]]:
    return [(span.get_attribute("data-origin"), span.get_attribute("textContent"))
            for span in panel.find_elements(By.CSS_SELECTOR, ".text .token")]


def api_marks(url: str, prompt: str, verification: str, max_tokens: int = 12, temperature: float = 0,
              seed: int = 0, drafter: str = "auto") -> list[tuple[str, str]]:
    out = client(url).completions.create(model="tiny-target", prompt=prompt, max_tokens=max_tokens,
                                         temperature=temperature, seed=seed, extra_body={
                                             "verification": verification, "provenance": True, "drafter": drafter})
    return [(r["origin"], r["token"]) for r in out.choices[0].provenance]


def test_the_page_builds_its_dial_from_the_servers_api(page):
    rules = [o.get_attribute("value") for o in page.find_elements(By.CSS_SELECTOR, "[data-dial=A] .rule option")]
    assert {"plain", "exact", "lossy", "static", "cactus", "typical", "diversed"} <= set(rules)
    assert "dynamic" not in rules  # a head's rule: offered as "diversed" with the loaded heads
    set_rule(page, "A", "diversed")
    heads = [o.text for o in page.find_elements(By.CSS_SELECTOR, "[data-dial=A] .head option")]
    assert "flat" in heads
    assert page.find_element(By.CSS_SELECTOR, "[data-dial=A] .head-row").is_displayed()
    legend = {li.find_element(By.CSS_SELECTOR, ".token").text
              for li in page.find_elements(By.CSS_SELECTOR, "#legend li")}
    assert legend == ORIGIN_NAMES


@pytest.mark.parametrize("rule, values, verification, temperature", [
    ("exact", {}, "exact", 0), ("lossy", {"lenience": 0.9}, "lossy:0.9", 1.0), ("plain", {}, "plain", 0)])
def test_a_prompt_streams_with_the_marks_the_api_reports(page, url, rule, values, verification, temperature):
    fill(page, "t3 t4 t5", temperature=temperature, seed=7)
    set_rule(page, "A", rule, **values)
    (panel,) = generate(page)
    assert panel.find_element(By.CSS_SELECTOR, "h2").text == f"A: {verification}"
    shown = marks(panel)
    assert shown == api_marks(url, "t3 t4 t5", verification, temperature=temperature, seed=7)
    assert {origin for origin, _ in shown} <= ORIGIN_NAMES
    spans = panel.find_elements(By.CSS_SELECTOR, ".text .token")
    assert all(f"origin-{s.get_attribute('data-origin')}" in s.get_attribute("class").split() for s in spans)
    if rule == "plain":
        assert {origin for origin, _ in shown} == {"target"}
        assert panel.find_element(By.CSS_SELECTOR, ".acceptance").text == "–"
    else:
        assert "%" in panel.find_element(By.CSS_SELECTOR, ".acceptance").text
        assert panel.find_element(By.CSS_SELECTOR, ".drafters").text.startswith("model ")


def test_a_heads_shift_and_the_drafter_travel_in_the_request(page, url):
    fill(page, "t5 t6 t7")
    set_rule(page, "A", "diversed")
    node = page.find_element(By.CSS_SELECTOR, "[data-dial=A].dial")
    Select(node.find_element(By.CSS_SELECTOR, ".head")).select_by_value("flat")
    shift = node.find_element(By.CSS_SELECTOR, ".shift")
    shift.clear()
    shift.send_keys("1")
    Select(node.find_element(By.CSS_SELECTOR, ".drafter")).select_by_value("model")
    (panel,) = generate(page)
    assert panel.find_element(By.CSS_SELECTOR, "h2").text == "A: diversed:flat@+1"
    assert not panel.find_element(By.CSS_SELECTOR, ".error").is_displayed()
    assert marks(panel) == api_marks(url, "t5 t6 t7", "diversed:flat@+1", drafter="model")
    assert panel.find_element(By.CSS_SELECTOR, ".drafters").text.startswith("model ")
    # a mixture head verifies the draft model's drafts only: with a copying drafter, the server's 400 shows
    Select(node.find_element(By.CSS_SELECTOR, ".drafter")).select_by_value("lookup")
    (panel,) = generate(page)
    assert "mixture head" in panel.find_element(By.CSS_SELECTOR, ".error").text


def test_compare_shows_two_settings_side_by_side(page, url):
    fill(page, "t6 t7 t8", max_tokens=10)
    set_rule(page, "A", "exact")
    page.find_element(By.ID, "compare").click()
    set_rule(page, "B", "static", weight=0.2)
    a, b = generate(page, answers=2)
    assert a.find_element(By.CSS_SELECTOR, "h2").text == "A: exact"
    assert b.find_element(By.CSS_SELECTOR, "h2").text == "B: static:0.2"
    assert marks(a) == api_marks(url, "t6 t7 t8", "exact", max_tokens=10)
    assert marks(b) == api_marks(url, "t6 t7 t8", "static:0.2", max_tokens=10)
    assert a.location["y"] == b.location["y"]  # side by side at desktop width


@pytest.mark.parametrize("prompt, rule, values, message", [
    ("", "exact", {}, "prompt is empty"),
    ("t3 t4", "static", {"weight": 3}, "weight must be in [0, 1], got 3"),
])
def test_bad_input_shows_the_servers_error(page, prompt, rule, values, message):
    fill(page, prompt)
    set_rule(page, "A", rule, **values)
    (panel,) = generate(page)
    error = panel.find_element(By.CSS_SELECTOR, ".error")
    assert error.is_displayed() and message in error.text
    assert error.get_attribute("role") == "alert"
    assert not panel.find_elements(By.CSS_SELECTOR, ".text .token")


def test_tokens_show_their_details_by_keyboard(page):
    fill(page, "t9 t10", seed=3)
    set_rule(page, "A", "exact")
    (panel,) = generate(page)
    text = panel.find_element(By.CSS_SELECTOR, ".text")
    text.send_keys(Keys.HOME)
    text.send_keys(Keys.ARROW_RIGHT)
    spans = panel.find_elements(By.CSS_SELECTOR, ".text .token")
    assert "selected" in spans[1].get_attribute("class").split()
    assert text.get_attribute("aria-activedescendant") == spans[1].get_attribute("id")
    details = page.find_element(By.ID, "details").text
    assert spans[1].get_attribute("data-origin") in details and "target probability p" in details
    assert page.execute_script("return document.activeElement") == text


def test_the_page_fits_a_phone(page):
    page.set_window_size(390, 844)
    fill(page, "t3 t4 t5")
    page.find_element(By.ID, "compare").click()
    generate(page, answers=2)
    assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
