// Helpers for the disaggregated-serving tests: start `moeserve prefill|decode|
// router|serve` processes on free ports (each prints its URL as its first
// stdout line), find a router's instances from its /metrics, wait for every
// instance's KV usage to return to its baseline, and run requests with a
// bounded concurrency. Every process started here is killed when the test
// process exits.
import { spawn } from 'node:child_process';
import { moeserveBin } from './server_harness.mjs';

const live = new Set();
process.on('exit', () => { for (const p of live) { try { p.kill('SIGKILL'); } catch {} } });

export async function startProcess(subcommand, args, { env = {}, timeoutMs = 120000 } = {}) {
  const proc = spawn(moeserveBin, [subcommand, '--port', '0', ...args],
                     { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } });
  live.add(proc);
  let stderr = '';
  proc.stderr.on('data', (d) => { stderr += d; if (process.env.MOESERVE_TEST_LOG) process.stderr.write(d); });
  const exited = new Promise((resolve) => proc.on('exit', (code, signal) => { live.delete(proc); resolve(code ?? signal); }));
  const url = await new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`${subcommand} did not start:\n${stderr}`)), timeoutMs);
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[0-9.]+:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`${subcommand} exited (${code}):\n${stderr}`)); });
  });
  return {
    proc, url, exited, stderr: () => stderr,
    alive: () => proc.exitCode === null && proc.signalCode === null,
    kill9() { proc.kill('SIGKILL'); return exited; },
    async stop() {
      if (proc.exitCode !== null || proc.signalCode !== null) return proc.exitCode ?? proc.signalCode;
      proc.kill('SIGTERM');
      const timer = setTimeout(() => proc.kill('SIGKILL'), 15000);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

// Prometheus text -> { 'name{label=value,...}': number } keeping every label.
export async function scrape(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const out = {};
  for (const line of text.split('\n')) {
    const m = line.match(/^(moeserve:[a-z_]+)(\{[^}]*\})? (\S+)$/);
    if (m) out[m[1] + (m[2] ? m[2].replace(/model_name="[^"]*",?/, '').replace('{}', '') : '')] = Number(m[3]);
  }
  return out;
}

// The instances a router knows, from moeserve:router_instance_healthy.
export async function routerInstances(routerUrl) {
  const m = await scrape(routerUrl);
  const out = { prefill: [], decode: [], healthy: {} };
  for (const [k, v] of Object.entries(m)) {
    const r = k.match(/^moeserve:router_instance_healthy\{role="(\w+)",instance="([^"]+)"\}$/);
    if (r) { out[r[1]].push(r[2]); out.healthy[r[2]] = v === 1; }
  }
  return out;
}

export async function waitFor(predicate, timeoutMs = 10000, stepMs = 50) {
  const start = Date.now();
  while (Date.now() - start < timeoutMs) {
    try { if (await predicate()) return true; } catch {}
    await new Promise((r) => setTimeout(r, stepMs));
  }
  return false;
}

// True once every given instance reports no KV pages in use, no running or
// waiting request and (decode) no reservation.
export async function atBaseline(urls) {
  for (const url of urls) {
    const m = await scrape(url);
    if (m['moeserve:kv_cache_usage_perc'] !== 0 || m['moeserve:num_requests_running'] !== 0 ||
        m['moeserve:num_requests_waiting'] !== 0) return false;
    if ((m['moeserve:disagg_reservations'] ?? 0) !== 0) return false;
  }
  return true;
}

export async function runPool(items, concurrency, fn) {
  const results = new Array(items.length);
  let next = 0;
  async function worker() {
    while (next < items.length) {
      const i = next++;
      try { results[i] = { ok: true, value: await fn(items[i], i) }; } catch (e) { results[i] = { ok: false, error: e }; }
    }
  }
  await Promise.all(Array.from({ length: Math.min(concurrency, items.length) }, worker));
  return results;
}

// A small deterministic PRNG (mulberry32) for prompt sets.
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6D2B79F5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
