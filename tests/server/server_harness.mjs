// Starts `moeserve serve` on a free port for a test file and stops it at the
// end (SIGTERM, then SIGKILL), so no process outlives the tests.
import { spawn } from 'node:child_process';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

export const repoRoot = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
export const moeserveBin = process.env.MOESERVE_BIN || path.join(repoRoot, 'build/bin/moeserve');

const live = new Set();
process.on('exit', () => { for (const p of live) { try { p.kill('SIGKILL'); } catch {} } });

export async function startServer(args, { timeoutMs = 60000 } = {}) {
  const proc = spawn(moeserveBin, ['serve', '--port', '0', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  live.add(proc);
  let stderr = '';
  proc.stderr.on('data', (d) => { stderr += d; if (process.env.MOESERVE_TEST_LOG) process.stderr.write(d); });
  const url = await new Promise((resolve, reject) => {
    let out = '';
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${stderr}`)), timeoutMs);
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on (http:\/\/[0-9.]+:\d+)/);
      if (m) { clearTimeout(timer); resolve(m[1]); }
    });
    proc.on('exit', (code) => { clearTimeout(timer); reject(new Error(`server exited (${code}):\n${stderr}`)); });
  });
  const port = Number(new URL(url).port);
  return {
    proc, url, port, stderr: () => stderr,
    async stop() {
      if (proc.exitCode !== null || proc.signalCode !== null) { live.delete(proc); return proc.exitCode; }
      const exited = new Promise((resolve) => proc.on('exit', (code, signal) => resolve(code ?? signal)));
      proc.kill('SIGTERM');
      const timer = setTimeout(() => proc.kill('SIGKILL'), 10000);
      const code = await exited;
      clearTimeout(timer);
      live.delete(proc);
      return code;
    },
  };
}

// Sends raw bytes and returns { status, headers, body, closed } of the reply
// (status 0 when the server closed without answering). The socket is not
// half-closed after sending unless endAfter: the server treats EOF as a
// client that went away.
export function rawRequest(port, chunks, { timeoutMs = 10000, delayMs = 0, endAfter = false } = {}) {
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1');
    let data = Buffer.alloc(0);
    const done = (closed) => {
      clearTimeout(timer);
      socket.destroy();
      const text = data.toString('latin1');
      const m = text.match(/^HTTP\/1\.1 (\d{3})/);
      const split = text.indexOf('\r\n\r\n');
      const head = split >= 0 ? text.slice(0, split) : text;
      const headers = {};
      for (const line of head.split('\r\n').slice(1)) {
        const i = line.indexOf(':');
        if (i > 0) headers[line.slice(0, i).toLowerCase()] = line.slice(i + 1).trim();
      }
      resolve({ status: m ? Number(m[1]) : 0, headers, body: split >= 0 ? text.slice(split + 4) : '', closed });
    };
    const timer = setTimeout(() => done(false), timeoutMs);
    socket.on('data', (d) => {
      data = Buffer.concat([data, d]);
      const text = data.toString('latin1');
      const split = text.indexOf('\r\n\r\n');
      const m = text.match(/content-length: (\d+)/i);
      if (split >= 0 && m && data.length >= split + 4 + Number(m[1])) done(false);
    });
    socket.on('close', () => done(true));
    socket.on('error', () => {});
    socket.on('connect', async () => {
      for (const c of chunks) {
        if (socket.destroyed) return;
        socket.write(c);
        if (delayMs) await new Promise((r) => setTimeout(r, delayMs));
      }
      if (endAfter && !socket.destroyed) socket.end();
    });
  });
}

export function httpPost(path, body, extraHeaders = '') {
  const b = Buffer.from(typeof body === 'string' ? body : JSON.stringify(body));
  return [Buffer.from(`POST ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n${extraHeaders}` +
                      `Content-Length: ${b.length}\r\nConnection: close\r\n\r\n`), b];
}

export async function metrics(url) {
  const text = await (await fetch(`${url}/metrics`)).text();
  const values = {};
  for (const line of text.split('\n')) {
    const m = line.match(/^(moeserve:[a-z_]+)\{([^}]*)\} (\S+)$/);
    if (m) values[m[1] + (m[2].includes('finished_reason') ? `{${m[2].match(/finished_reason="(\w+)"/)[1]}}` : '') +
                  (m[2].includes('le=') ? `{le=${m[2].match(/le="([^"]+)"/)[1]}}` : '')] = Number(m[3]);
  }
  return values;
}

export async function waitFor(predicate, timeoutMs = 5000) {
  const start = Date.now();
  while (Date.now() - start < timeoutMs) {
    if (await predicate()) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return false;
}
