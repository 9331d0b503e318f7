// The console's GraphQL client: its operations by persisted hash over HTTP (queries by GET, so a
// cache may keep them; mutations by POST), and one graphql-transport-ws connection for the live
// event stream that resumes from its last cursor after every reconnect.

import ops from './operations.js';

const TOKEN_KEY = 'compute.token';

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/// An error the API answered, with its stable `extensions.code`.
export class ApiError extends Error {
  constructor(message, code, errors) {
    super(message);
    this.code = code || 'UNKNOWN';
    this.errors = errors || [];
  }
}

function headers() {
  const h = { Accept: 'application/graphql-response+json, application/json' };
  const t = token();
  if (t) h.Authorization = `Bearer ${t}`;
  return h;
}

function persisted(op) {
  return { persistedQuery: { version: 1, sha256Hash: op.hash } };
}

async function send(op, name, variables, withText) {
  const extensions = persisted(op);
  let response;
  if (op.kind === 'query') {
    const url = new URL('/graphql', location.href);
    url.searchParams.set('operationName', name);
    url.searchParams.set('variables', JSON.stringify(variables || {}));
    url.searchParams.set('extensions', JSON.stringify(extensions));
    if (withText) url.searchParams.set('query', op.query);
    response = await fetch(url, { headers: headers() });
  } else {
    const body = { operationName: name, variables: variables || {}, extensions };
    if (withText) body.query = op.query;
    response = await fetch('/graphql', {
      method: 'POST',
      headers: { ...headers(), 'Content-Type': 'application/json' },
      body: JSON.stringify(body),
    });
  }
  let json;
  try {
    json = await response.json();
  } catch {
    throw new ApiError(`the server answered ${response.status} without JSON`, 'BAD_RESPONSE');
  }
  return json;
}

/// Runs one of the console's operations; resolves to its `data`, or throws an `ApiError` with
/// the first error's code.
export async function gql(name, variables) {
  const op = ops[name];
  if (!op) throw new ApiError(`the console has no operation ${name}`, 'INTERNAL');
  let json = await send(op, name, variables, false);
  // Over this caller's query budget: wait as long as the server says, twice at most.
  for (let i = 0; i < 2 && rateLimited(json) !== null; i++) {
    const seconds = rateLimited(json);
    window.dispatchEvent(new CustomEvent('compute:rate-limited', { detail: { seconds, name } }));
    await new Promise((r) => setTimeout(r, seconds * 1000));
    json = await send(op, name, variables, false);
  }
  const first = json.errors && json.errors[0];
  // A server that does not know the console's hash (a different build behind a proxy): send the
  // text once, as automatic persisted queries do.
  if (first && first.extensions && first.extensions.code === 'PERSISTED_QUERY_NOT_FOUND') {
    json = await send(op, name, variables, true);
  }
  if (json.errors && json.errors.length) {
    const e = json.errors[0];
    throw new ApiError(e.message, e.extensions && e.extensions.code, json.errors);
  }
  return json.data;
}

function rateLimited(json) {
  const e = json.errors && json.errors[0];
  if (!e || !e.extensions || e.extensions.code !== 'RATE_LIMITED') return null;
  return Math.min(60, Math.max(1, Number(e.extensions.retryAfterSeconds) || 5));
}

/// A mutation that carries an idempotency key in its input: retried with the same variables (so
/// the same key) after a network error or while the first attempt still holds the key.
export async function mutate(name, variables, attempts = 4) {
  for (let i = 1; ; i++) {
    try {
      return await gql(name, variables);
    } catch (e) {
      const retriable = e instanceof TypeError || (e instanceof ApiError && e.code === 'IDEMPOTENCY_IN_PROGRESS');
      if (!retriable || i >= attempts) throw e;
      await new Promise((r) => setTimeout(r, 200 * 2 ** i));
    }
  }
}

/// A fresh idempotency key.
export function newKey() {
  if (crypto.randomUUID) return `console-${crypto.randomUUID()}`;
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return `console-${Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('')}`;
}

/// The live event stream: `events(after:)` over graphql-transport-ws. It reconnects with backoff
/// and resumes after the last cursor it delivered, so nothing is missed; an event seen twice
/// across a reconnect (the stream is at least once) is delivered once, by id.
export class Live {
  constructor({ onEvent, onStatus, after }) {
    this.onEvent = onEvent;
    this.onStatus = onStatus || (() => {});
    this.cursor = after || null;
    this.seen = new Set();
    this.order = [];
    this.reconnects = 0;
    this.closed = false;
    this.connect();
  }

  status(state, detail) {
    this.state = state;
    this.onStatus({ state, detail, cursor: this.cursor, reconnects: this.reconnects });
  }

  connect() {
    if (this.closed) return;
    const url = new URL('/graphql', location.href);
    url.protocol = url.protocol === 'https:' ? 'wss:' : 'ws:';
    const ws = new WebSocket(url, 'graphql-transport-ws');
    this.ws = ws;
    this.status('connecting');
    ws.onopen = () => {
      ws.send(JSON.stringify({ type: 'connection_init', payload: { Authorization: `Bearer ${token()}` } }));
    };
    ws.onmessage = (m) => {
      let msg;
      try {
        msg = JSON.parse(m.data);
      } catch {
        return;
      }
      if (msg.type === 'connection_ack') {
        this.backoff = 0;
        const op = ops.ConsoleEvents;
        ws.send(JSON.stringify({
          id: 'events',
          type: 'subscribe',
          payload: { operationName: 'ConsoleEvents', variables: { after: this.cursor }, extensions: persisted(op) },
        }));
        this.status('live');
      } else if (msg.type === 'ping') {
        ws.send(JSON.stringify({ type: 'pong' }));
      } else if (msg.type === 'next' && msg.payload) {
        if (msg.payload.errors && msg.payload.errors.length) {
          this.status('error', msg.payload.errors[0].message);
          return;
        }
        const event = msg.payload.data && msg.payload.data.events;
        if (!event) return;
        this.cursor = event.cursor;
        if (this.seen.has(event.id)) return;
        this.seen.add(event.id);
        this.order.push(event.id);
        if (this.order.length > 5000) this.seen.delete(this.order.shift());
        this.onEvent(event);
      } else if (msg.type === 'error') {
        const e = (msg.payload && msg.payload[0]) || {};
        this.status('error', `${(e.extensions && e.extensions.code) || ''} ${e.message || ''}`.trim());
      } else if (msg.type === 'complete') {
        ws.close();
      }
    };
    ws.onclose = (e) => {
      if (this.closed) return;
      if (e.code === 4403 || e.code === 4401) {
        this.status('forbidden', e.reason);
        return;
      }
      this.reconnects++;
      this.backoff = Math.min(10000, (this.backoff || 250) * 2);
      this.status('reconnecting', `in ${Math.round(this.backoff / 100) / 10} s`);
      this.timer = setTimeout(() => this.connect(), this.backoff);
    };
  }

  /// Drops the connection as a network failure would (the console's "Reconnect" button).
  drop() {
    if (this.ws) this.ws.close();
  }

  close() {
    this.closed = true;
    clearTimeout(this.timer);
    if (this.ws) this.ws.close();
  }
}
