// Unit tests of the plugin's turn sizing (finding 4) and media token counts (finding 2), no service:
// `node --test test/`. test/findings.test.js runs the same findings against a real service.
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  cutToJsonBytes, imageSize, imageTokens, jsonBytes, mediaTokens, roughTokens, storedInGroups, storedTurn, toStored,
} from "../src/messages.js";
import { assistantMessage, logOf, MiB, pngOf, toolCall, toolResult, userMessage } from "../testing/messages.js";



test("finding 4: any turn is stored within the turn limit, a turn of several groups too", () => {
  const limit = 8 * MiB;
  const result = (id, mib) => toolResult(id, logOf(id, mib));
  const small = [userMessage("hello"), toolCall("a", "read", {}), toolResult("a", "short"), assistantMessage("done")];
  // A turn under the limit is stored as each message alone.
  assert.deepEqual(storedTurn(small, { turnLimit: limit }), small.map((m) => toStored(m)));
  // A user message in the middle of a turn (a steering message) opens a second group.
  const turn = [userMessage("go"), toolCall("a", "read", {}), result("a", 3), toolCall("b", "read", {}), result("b", 3),
    userMessage(`also this\n${logOf("steer", 1.5)}`), toolCall("c", "read", {}), result("c", 3.5),
    toolCall("d", "read", {}), result("d", 3.5), assistantMessage("done")];
  const stored = storedTurn(turn, { turnLimit: limit });
  const total = stored.reduce((sum, m) => sum + jsonBytes(m), 0);
  assert.ok(total <= limit - 64 * 1024, `${total} bytes`);
  assert.deepEqual(stored[0], toStored(turn[0]));
  assert.equal(stored.at(-1).content, "done");
  assert.ok(stored.filter((m) => /cut by transcript-store: the turn is over/.test(m.content)).length >= 3);
  // Each group's share depends on its earlier messages only: what follows never changes a message.
  const grouped = storedInGroups(turn, { turnLimit: limit }).stored;
  const prefix = storedInGroups(turn.slice(0, 5), { turnLimit: limit }).stored;
  assert.deepEqual(grouped.slice(0, 5), prefix);
  // ... and a page read from the middle of a group, given what the group weighed so far, stores the same.
  const first = storedInGroups(turn.slice(0, 3), { turnLimit: limit });
  assert.deepEqual(storedInGroups(turn.slice(3, 5), { turnLimit: limit, state: first.state }).stored, grouped.slice(3, 5));
});

test("finding 2: image sizes are read from their data, and images and thinking are counted", () => {
  assert.deepEqual(imageSize(pngOf(1200, 900)), { width: 1200, height: 900 });
  const gif = Buffer.alloc(64); gif.write("GIF89a", 0, "latin1"); gif.writeUInt16LE(320, 6); gif.writeUInt16LE(200, 8);
  assert.deepEqual(imageSize(gif.toString("base64")), { width: 320, height: 200 });
  const jpeg = Buffer.alloc(64);
  Buffer.from([0xff, 0xd8, 0xff, 0xe0, 0x00, 0x10]).copy(jpeg, 0); // SOI, an APP0 segment of 16 bytes
  Buffer.from([0xff, 0xc0, 0x00, 0x11, 0x08, 0x02, 0x58, 0x03, 0x20]).copy(jpeg, 20); // SOF0: 600 high, 800 wide
  assert.deepEqual(imageSize(jpeg.toString("base64")), { width: 800, height: 600 });
  const webp = Buffer.alloc(64); webp.write("RIFF", 0, "latin1"); webp.write("WEBPVP8X", 8, "latin1");
  webp.writeUIntLE(1023, 24, 3); webp.writeUIntLE(767, 27, 3);
  assert.deepEqual(imageSize(webp.toString("base64")), { width: 1024, height: 768 });
  assert.equal(imageSize("not an image at all, only some base64-looking text"), null);
  assert.equal(imageTokens({ type: "image", data: pngOf(1200, 900) }), 1440);
  assert.equal(imageTokens({ type: "image", data: pngOf(4000, 3000) }), 1534); // scaled to 1.15 megapixels
  assert.equal(imageTokens({ type: "image", data: pngOf(16, 16) }), 85);
  assert.equal(imageTokens({ type: "image", data: "????" }), 1600); // unknown: the most an image costs
  assert.equal(roughTokens("word word"), 3);
  assert.equal(mediaTokens(assistantMessage([{ type: "thinking", thinking: "abcd".repeat(100) }, { type: "text", text: "x" }])), 100);
  assert.equal(mediaTokens(userMessage("no parts")), 0);
});

test("a turn of many tool results, each under the smallest share, is still stored within the turn limit", () => {
  // 700 tool calls with a 7 KiB result each: 5 MiB in OpenClaw (which closes turns of up to 8 MiB), 10 MiB
  // stored (each result kept twice, 14 KiB, under the 16 KiB a message always kept). Nothing was cut: the
  // service refused the commit (413 payload_too_large) on every replay, and the session stayed on legacy.
  const limit = 8 * MiB;
  const turn = [userMessage("process every file")];
  for (let i = 0; i < 700; i += 1) {
    turn.push(toolCall(`c${i}`, "read", { path: `src/file-${i}.js` }), toolResult(`c${i}`, logOf(`line-${i}`, 7 / 1024)));
  }
  turn.push(assistantMessage("all done"));
  assert.ok(jsonBytes(turn) < 6 * MiB);
  const stored = storedTurn(turn, { turnLimit: limit });
  const total = stored.reduce((sum, m) => sum + jsonBytes(m), 0);
  assert.ok(total <= limit - 64 * 1024, `${total} bytes`);
  assert.deepEqual(stored[0], toStored(turn[0]));
  assert.equal(stored.at(-1).content, "all done");
  // Cut to what the turn leaves each (about 11 KiB stored), not to the least a message keeps.
  const kept = stored[2].content.split("\n[... ")[0].length;
  assert.ok(kept > 6000, `${kept} characters kept`);
  // 1500 results of 3.5 KiB (7 KiB stored each) too.
  const more = [userMessage("again")];
  for (let i = 0; i < 1500; i += 1) more.push(toolResult(`d${i}`, logOf(`row-${i}`, 3.5 / 1024)));
  assert.ok(jsonBytes(more) < 8 * MiB);
  const sum = storedTurn(more, { turnLimit: limit }).reduce((bytes, m) => bytes + jsonBytes(m), 0);
  assert.ok(sum <= limit - 64 * 1024, `${sum} bytes`);
});

test("a text is cut to the JSON bytes it may take, escapes and pairs counted, a pair never split", () => {
  const note = "the prompt is over the limit";
  assert.equal(cutToJsonBytes("short", 100, note), "short");
  assert.equal(cutToJsonBytes("x".repeat(5000), 60, note), null); // not even the marker fits
  for (const unit of ["a", "\"", "\\", "\n", "\u0001", "\u00e9", "\u20ac", "\u{1f642}", "a\u{1f642}"]) {
    const text = unit.repeat(20000 / unit.length);
    for (const max of [1000, 4097, 9999]) {
      const cut = cutToJsonBytes(text, max, note);
      const kept = cut.slice(0, cut.indexOf("\n[... "));
      assert.ok(jsonBytes(cut) <= max && jsonBytes(cut) > max - 8, `${JSON.stringify(unit)} ${max}: ${jsonBytes(cut)}`);
      assert.ok(text.startsWith(kept) && kept.isWellFormed());
      assert.equal(cut.slice(kept.length), `\n[... ${text.length - kept.length} characters cut by transcript-store: ${note}]`);
    }
  }
});
