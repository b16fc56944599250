// Runs SQL queries against a trace with the Perfetto trace processor's wasm build under Node.
//
// Usage: node trace_processor_query.mjs ASSETS_DIR TRACE_FILE < queries.json
//   ASSETS_DIR holds trace_processor.wasm, engine_bundle.node.js and engine.mjs (the trace
//   processor v55.3 as `cargo xtask setup` caches it, checksums checked there).
//   stdin: a JSON array of SQL strings. stdout: one JSON object
//   {"results": [{"columns": [...], "rows": [[...], ...]} | {"error": "..."}]}.
//   Integers are printed as decimal strings: timestamps exceed 2^53 and must stay exact.
//
// The wasm bundle is written for a browser Web Worker. This glue gives it what it looks for
// there, without touching its code except one switch: `self` and `WorkerGlobalScope` (so it
// takes its worker path), `location` (the base it resolves the wasm's name against), and a
// synchronous XMLHttpRequest that answers only with the local wasm bytes (so the binary comes
// from disk, never from a network). The memory64 build is not shipped in these assets, so the
// bridge is pinned to the 32-bit build even on a Node whose V8 supports memory64. The bridge is
// reached the way a worker's host reaches it: one bootstrap message carrying a MessagePort.
// The client side is the trace processor's own RPC client (`EngineBase` in engine.mjs).

import { readFileSync } from "node:fs";
import { join, resolve, basename } from "node:path";
import { pathToFileURL, fileURLToPath } from "node:url";
import vm from "node:vm";

const [assetsArg, traceArg] = process.argv.slice(2);
if (!assetsArg || !traceArg) {
  console.error("usage: node trace_processor_query.mjs ASSETS_DIR TRACE_FILE < queries.json");
  process.exit(2);
}
const assets = resolve(assetsArg);
const queries = JSON.parse(readFileSync(0, "utf8"));
if (!Array.isArray(queries) || queries.some((q) => typeof q !== "string")) {
  console.error("stdin must be a JSON array of SQL strings");
  process.exit(2);
}

// stdout carries only the JSON answer: the wasm module's own prints go to stderr.
console.log = console.error;

// The worker's environment, as far as the bundle inspects it.
globalThis.self = globalThis;
globalThis.WorkerGlobalScope = function WorkerGlobalScope() {};
globalThis.location = { href: pathToFileURL(join(assets, "engine_bundle.node.js")).href };
const wasmBytes = readFileSync(join(assets, "trace_processor.wasm"));
globalThis.XMLHttpRequest = class {
  open(method, url) {
    this.url = String(url);
  }
  send() {
    // Only the wasm the bundle asks for by name is served; anything else is a bug to see.
    const name = basename(this.url.startsWith("file:") ? fileURLToPath(this.url) : this.url);
    if (name !== "trace_processor.wasm") {
      throw new Error(`trace processor glue: unexpected request for ${this.url}`);
    }
    const b = wasmBytes;
    this.response = b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
    this.status = 200;
  }
};

const MEMORY64_SWITCH = "this.useMemory64 = hasMemory64Support();";
let bundle = readFileSync(join(assets, "engine_bundle.node.js"), "utf8");
if (!bundle.includes(MEMORY64_SWITCH)) {
  console.error("trace processor glue: engine_bundle.node.js is not the expected v55.3 build");
  process.exit(3);
}
bundle = bundle.replace(MEMORY64_SWITCH, "this.useMemory64 = false;");
vm.runInThisContext(bundle, { filename: "engine_bundle.node.js" });
if (typeof self.onmessage !== "function") {
  console.error("trace processor glue: the bundle installed no worker message handler");
  process.exit(3);
}

const { EngineBase } = await import(pathToFileURL(join(assets, "engine.mjs")).href);
class NodeEngine extends EngineBase {
  mode = "WASM";
  id = "node";
  constructor(port) {
    super();
    this.port = port;
    this.port.onmessage = (m) => this.onRpcResponseBytes(m.data);
  }
  rpcSendRequestBytes(data) {
    this.port.postMessage(data);
  }
}

const channel = new MessageChannel();
self.onmessage({ data: channel.port1 });
const engine = new NodeEngine(channel.port2);

// The wasm runtime initialises asynchronously; requests queued on the port before that are
// handled once it is up, because the bridge reads the port only after initialising.
const trace = readFileSync(resolve(traceArg));
const CHUNK = 16 * 1024 * 1024;
for (let off = 0; off < trace.length; off += CHUNK) {
  await engine.parse(new Uint8Array(trace.subarray(off, off + CHUNK)));
}
await engine.notifyEof();

const cell = (v) => (typeof v === "bigint" ? v.toString() : v instanceof Uint8Array ? Array.from(v) : v);
const results = [];
for (const sql of queries) {
  const r = await engine.query(sql);
  const err = r.error();
  if (err) {
    results.push({ error: err });
    continue;
  }
  const columns = r.columns();
  const rows = [];
  for (const it = r.iter({}); it.valid(); it.next()) {
    rows.push(columns.map((c) => cell(it.get(c))));
  }
  results.push({ columns, rows });
}
channel.port1.close();
channel.port2.close();
// Exit only once the answer is written: a pipe takes it in pieces, and exiting earlier would
// cut it.
process.stdout.write(JSON.stringify({ results }) + "\n", () => process.exit(0));
