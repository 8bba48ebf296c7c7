#!/usr/bin/env node
// An independent HBONE peer built on Node.js's own `http2` module (no npm
// packages), for ztwisted's interop tests.
//
//   node node_hbone.js client <config.json>   CONNECT tunnel(s), then exit
//   node node_hbone.js server <config.json>   serve CONNECT until killed
//
// Every line on stdout is one JSON event ({"event": ...}); the test reads
// them. Diagnostics go to stderr. Exit codes: 0 ok, 1 tunnel failed,
// 2 usage, 3 timed out.
//
// Config (JSON), both modes: key, cert (leaf + chain), ca (trust roots), PEM paths.
//   client: connect {host, port}, localAddress, authority, expectServerIdentity,
//           payload (file), output (file prefix), timeoutMs, tunnels, resetTunnels,
//           earlyBytes, holdAfterBytes, chunkSize, chunkIntervalMs, lockstep,
//           awaitServerClose (after the tunnels, wait for the server to end the
//           connection and report how: "connection_ended")
//   server: listen {host, port}, allowedTargets ["ip:port"], goawayAfterResponse, banner,
//           closeOnStdin (a line on stdin: server.close() and session.close() on every session)
'use strict';

const fs = require('fs');
const http2 = require('http2');
const net = require('net');
const { Duplex } = require('stream');
const tls = require('tls');

function emit(event, fields) {
  process.stdout.write(JSON.stringify({ event, ...fields }) + '\n');
}

function fail(message, code = 1) {
  emit('error', { message });
  process.stderr.write(`node_hbone: ${message}\n`);
  process.exit(code);
}

// The URI SANs of a peer certificate, from Node's "URI:a, DNS:b" string.
function uriSans(cert) {
  if (!cert || !cert.subjectaltname) return [];
  return cert.subjectaltname
    .split(', ')
    .filter((entry) => entry.startsWith('URI:'))
    .map((entry) => entry.slice('URI:'.length));
}

function tlsOptions(config) {
  return {
    key: fs.readFileSync(config.key),
    cert: fs.readFileSync(config.cert), // leaf followed by its issuing chain
    ca: fs.readFileSync(config.ca),
    minVersion: 'TLSv1.3',
    ALPNProtocols: ['h2'],
  };
}

function splitAuthority(authority) {
  const match = /^\[?([^\]]+)\]?:(\d+)$/.exec(authority || '');
  if (!match) return null;
  return { host: match[1], port: Number(match[2]) };
}

// -- client: CONNECT tunnels (config.tunnels, default 1) on one session, each
//    echoing the payload; echoes are written to <config.output>.<index> -------

function runClient(config) {
  const payload = fs.readFileSync(config.payload);
  const timer = setTimeout(
    () => fail(`no complete echo within ${config.timeoutMs} ms; bytes so far: ${JSON.stringify(progress)}`, 3),
    config.timeoutMs,
  );

  const options = {
    ...tlsOptions(config),
    localAddress: config.localAddress,
    // HBONE has no host names: the server is identified by its SPIFFE ID.
    checkServerIdentity: (host, cert) => {
      const sans = uriSans(cert);
      if (!sans.includes(config.expectServerIdentity)) {
        return new Error(`server presented ${sans.join(', ') || 'no URI SAN'}, expected ${config.expectServerIdentity}`);
      }
      return undefined;
    },
  };
  const ending = config.awaitServerClose ? new EndingWatch() : null;
  if (ending !== null) {
    options.createConnection = () => ending.connect(config, options);
  }
  const session = http2.connect(`https://${config.connect.host}:${config.connect.port}`, options);
  session.on('error', (err) => fail(`HTTP/2 session error: ${err.message}`));

  session.on('connect', (_session, socket) => {
    emit('connected', {
      alpn: session.alpnProtocol,
      tlsVersion: socket.getProtocol(),
      serverIdentities: uriSans(socket.getPeerCertificate()),
    });
  });

  session.on('goaway', (errorCode, lastStreamID) => emit('goaway', { errorCode, lastStreamID }));

  const count = config.tunnels || 1;
  const results = [];
  let finished = 0;
  for (let index = 0; index < count; index++) {
    openTunnel(config, session, payload, index, (result) => {
      results[index] = result;
      finished += 1;
      if (finished === count) {
        clearTimeout(timer);
        emit('done', { tunnels: results });
        if (ending !== null) {
          ending.whenEnded(config.timeoutMs, (report) => {
            emit('connection_ended', report);
            process.exit(0);
          });
          return;
        }
        // The server may have closed the session already; do not wait forever.
        session.close(() => process.exit(0));
        setTimeout(() => process.exit(0), 2000);
      }
    });
  }
}

// How the server ended the connection, seen from both layers: TLS runs over a
// Duplex that relays a plain TCP socket, so the TLS socket's 'end' (the TLS
// stream is over) can be told apart from the TCP socket's 'end' (FIN). The
// TLS stream can only end before the FIN arrives if the server sent
// close_notify; an RST shows as a TCP error (ECONNRESET).
class EndingWatch {
  constructor() {
    this.events = [];
    this.errors = [];
    this.closed = false;
    this.onClosed = null;
  }

  note(what) {
    this.events.push(what);
  }

  connect(config, options) {
    const tcp = net.connect({ host: config.connect.host, port: config.connect.port, localAddress: config.localAddress, allowHalfOpen: true });
    const relay = new Duplex({
      allowHalfOpen: true,
      read() {
        tcp.resume();
      },
      write(chunk, _encoding, callback) {
        tcp.write(chunk, callback);
      },
      final(callback) {
        this.watch.note('tls-sent-fin');
        tcp.end();
        callback();
      },
      destroy(err, callback) {
        tcp.destroy();
        callback(err);
      },
    });
    relay.watch = this;
    tcp.on('data', (chunk) => {
      if (!relay.push(chunk)) tcp.pause();
    });
    tcp.on('end', () => {
      this.note('tcp-end');
      relay.push(null);
    });
    tcp.on('error', (err) => {
      this.errors.push(`tcp: ${err.code || err.message}`);
      relay.destroy(err);
    });
    tcp.on('close', () => {
      this.note('tcp-close');
      this.closed = true;
      if (this.onClosed !== null) this.onClosed();
    });
    const socket = tls.connect({ ...options, host: config.connect.host, socket: relay });
    socket.on('end', () => this.note('tls-end'));
    socket.on('error', (err) => this.errors.push(`tls: ${err.code || err.message}`));
    socket.on('close', (hadError) => this.note(hadError ? 'tls-close-with-error' : 'tls-close'));
    return socket;
  }

  report() {
    const tlsEnd = this.events.indexOf('tls-end');
    const tcpEnd = this.events.indexOf('tcp-end');
    return {
      events: this.events,
      errors: this.errors,
      // TLS ended while TCP was still open: the server sent close_notify first.
      closeNotify: tlsEnd !== -1 && (tcpEnd === -1 || tlsEnd < tcpEnd),
      clean: this.errors.length === 0 && !this.events.includes('tls-close-with-error'),
    };
  }

  whenEnded(timeoutMs, callback) {
    const finish = () => setImmediate(() => callback(this.report()));
    if (this.closed) {
      finish();
      return;
    }
    const timer = setTimeout(() => fail(`the server did not end the connection within ${timeoutMs} ms: ${JSON.stringify(this.report())}`, 3), timeoutMs);
    this.onClosed = () => {
      clearTimeout(timer);
      finish();
    };
  }
}

// How the payload goes out (all optional, in this order):
//   earlyBytes      sent right after the CONNECT, before the response (allowed:
//                   the stream is open once HEADERS are sent)
//   holdAfterBytes  then, after the response, send up to this offset, report
//                   "holding", and continue only after a line on stdin
//   chunkSize, chunkIntervalMs   then trickle the rest in chunks, pausing between;
//                   with lockstep, each chunk waits until everything sent so far
//                   came back (a request/response exchange: little in flight)
// and END_STREAM after the last byte.
// Per tunnel: bytes handed to the stream (written) and echoed back (received).
const progress = [];

let released = null;
function whenReleased(callback) {
  if (released === null) {
    released = new Promise((resolve) => {
      process.stdin.once('data', () => resolve());
    });
  }
  released.then(callback);
}

function sendPayload(config, request, payload, index, offset, whenEchoed) {
  const hold = config.holdAfterBytes;
  if (hold !== undefined && offset < hold && hold < payload.length) {
    request.write(payload.subarray(offset, hold), () => {
      emit('holding', { index, sent: hold });
      whenReleased(() => sendPayload({ ...config, holdAfterBytes: undefined }, request, payload, index, hold, whenEchoed));
    });
    return;
  }
  if (!config.chunkSize) {
    request.end(payload.subarray(offset));
    return;
  }
  const trickle = (position) => {
    if (position >= payload.length) {
      request.end();
      return;
    }
    const next = Math.min(position + config.chunkSize, payload.length);
    request.write(payload.subarray(position, next), () => {
      progress[index].written = next;
      const proceed = () => setTimeout(() => trickle(next), config.chunkIntervalMs || 0);
      if (config.lockstep) whenEchoed(next, proceed);
      else proceed();
    });
  };
  trickle(offset);
}

function openTunnel(config, session, payload, index, onDone) {
  const request = session.request({ ':method': 'CONNECT', ':authority': config.authority, ...(config.headers || {}) });
  const received = [];
  let receivedBytes = 0;
  let status = null;
  let echoWaiter = null;
  progress[index] = { written: 0, received: 0 };
  const whenEchoed = (bytes, callback) => {
    if (receivedBytes >= bytes) callback();
    else echoWaiter = { bytes, callback };
  };
  const early = Math.min(config.earlyBytes || 0, payload.length);
  if (early > 0) {
    request.write(payload.subarray(0, early));
  }

  // config.resetTunnels: these tunnels send RST_STREAM(CANCEL) on their first echoed bytes.
  const resetting = (config.resetTunnels || []).includes(index);
  let finished = false;
  const finish = (result) => {
    if (!finished) {
      finished = true;
      onDone(result);
    }
  };

  request.on('response', (headers) => {
    status = Number(headers[':status']);
    emit('response', { index, status });
    if (status !== 200) {
      fail(`CONNECT ${config.authority} answered ${status}`);
    }
    sendPayload(config, request, payload, index, early, whenEchoed);
  });
  request.on('data', (chunk) => {
    received.push(chunk);
    receivedBytes += chunk.length;
    progress[index].received = receivedBytes;
    if (resetting && !request.closed) {
      request.close(http2.constants.NGHTTP2_CANCEL);
      emit('reset_sent', { index, streamId: request.id, received: receivedBytes });
      finish({ index, status, streamId: request.id, reset: true, received: receivedBytes });
      return;
    }
    if (echoWaiter !== null && receivedBytes >= echoWaiter.bytes) {
      const { callback } = echoWaiter;
      echoWaiter = null;
      callback();
    }
  });
  request.on('end', () => {
    fs.writeFileSync(`${config.output}.${index}`, Buffer.concat(received, receivedBytes));
    finish({ index, status, streamId: request.id, sent: payload.length, received: receivedBytes });
  });
  request.on('error', (err) => {
    if (!resetting) fail(`CONNECT stream ${index} error: ${err.message}`);
  });
}

// -- server: CONNECT to the requested local address, then splice ---------------

function runServer(config) {
  const server = http2.createSecureServer({
    ...tlsOptions(config),
    requestCert: true,
    rejectUnauthorized: true,
    allowHTTP1: false,
  });

  server.on('tlsClientError', (err, socket) => {
    emit('tls_error', { message: err.message, peer: `${socket.remoteAddress}:${socket.remotePort}` });
  });
  server.on('sessionError', (err) => emit('session_error', { message: err.message }));
  const sessions = new Set();
  server.on('session', (session) => {
    const socket = session.socket;
    const source = `${socket.remoteAddress}:${socket.remotePort}`;
    emit('session', { source });
    sessions.add(session);
    session.on('close', () => {
      sessions.delete(session);
      emit('session_closed', { source });
    });
  });
  if (config.closeOnStdin) {
    process.stdin.once('data', () => {
      // server.close() only stops listening (Node 20 leaves open sessions
      // alone); a graceful shutdown also closes each session: GOAWAY with the
      // last stream processed, the streams in flight finish, then the socket ends.
      server.close(() => emit('server_closed', {}));
      for (const session of sessions) session.close();
      emit('server_closing', { sessions: sessions.size });
    });
  }

  server.on('stream', (stream, headers) => {
    const socket = stream.session.socket;
    const peerIdentities = uriSans(socket.getPeerCertificate());
    const method = headers[':method'];
    const authority = headers[':authority'];
    const plain = {};
    for (const [name, value] of Object.entries(headers)) plain[name] = String(value);
    emit('request', {
      method,
      authority,
      headers: plain,
      peerIdentities,
      alpn: stream.session.alpnProtocol,
      tlsVersion: socket.getProtocol(),
      source: `${socket.remoteAddress}:${socket.remotePort}`,
    });
    stream.on('error', (err) => emit('stream_error', { authority, message: err.message }));

    const target = splitAuthority(authority);
    if (method !== 'CONNECT' || target === null || !config.allowedTargets.includes(authority)) {
      stream.respond({ ':status': method !== 'CONNECT' ? 405 : 400 }, { endStream: true });
      return;
    }
    let received = 0;
    const upstream = net.connect({ host: target.host, port: target.port, allowHalfOpen: true });
    upstream.on('connect', () => {
      stream.respond({ ':status': 200 });
      if (config.banner) {
        // Server-first protocols: bytes right behind the 200, in the same write.
        stream.write(config.banner);
      }
      if (config.goawayAfterResponse) {
        // Graceful: this stream is the last one served on the session.
        stream.session.goaway(http2.constants.NGHTTP2_NO_ERROR, stream.id);
        emit('goaway_sent', { lastStreamID: stream.id });
      }
      // pipe() half-closes each side when the other one ends.
      stream.pipe(upstream);
      upstream.pipe(stream);
      // Attached after pipe(), so no data can flow before the splice exists.
      stream.on('data', (chunk) => {
        received += chunk.length;
      });
    });
    upstream.on('error', (err) => {
      emit('upstream_error', { authority, message: err.message });
      if (!stream.headersSent) {
        stream.respond({ ':status': 503 }, { endStream: true });
      } else {
        stream.close(http2.constants.NGHTTP2_CANCEL);
      }
    });
    stream.on('close', () => {
      emit('stream_closed', { authority, received, rstCode: stream.rstCode });
      upstream.destroy();
    });
  });

  server.listen(config.listen.port, config.listen.host, () => {
    emit('listening', { host: config.listen.host, port: config.listen.port });
  });
  for (const signal of ['SIGTERM', 'SIGINT']) {
    process.on(signal, () => process.exit(0));
  }
}

function main() {
  const [mode, configPath] = process.argv.slice(2);
  if (!['client', 'server'].includes(mode) || !configPath) {
    fail('usage: node_hbone.js client|server <config.json>', 2);
  }
  const config = JSON.parse(fs.readFileSync(configPath, 'utf8'));
  if (mode === 'client') runClient(config);
  else runServer(config);
}

main();
