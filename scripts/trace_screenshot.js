// Renders a page to PNG with Debian's headless Chromium (npm: puppeteer-core), for the pictures in
// docs/debugging.md. Serve the folder first (python3 -m http.server 8123), then:
//   node trace_screenshot.js http://127.0.0.1:8123/trace.svg out.png 1500 440
//   node trace_screenshot.js 'http://127.0.0.1:8123/speedscope/index.html#profileURL=...' out.png 1500 420 3
// The last argument presses speedscope's "n" (next thread) that many times.
const puppeteer = require('puppeteer-core');
const [url, png, width, height, next] = process.argv.slice(2);
(async () => {
  const browser = await puppeteer.launch({executablePath: '/usr/bin/chromium', headless: 'new',
                                          args: ['--no-sandbox', '--disable-gpu']});
  const page = await browser.newPage();
  await page.setViewport({width: +width, height: +height});
  await page.goto(url, {waitUntil: 'load'});
  await new Promise(r => setTimeout(r, 3000));
  for (let i = 0; i < +(next || 0); ++i) {
    await page.keyboard.press('n');
    await new Promise(r => setTimeout(r, 500));
  }
  await page.screenshot({path: png});
  await browser.close();
})();
