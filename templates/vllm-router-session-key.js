// Managed by gpufleet: changes here are overwritten by the next deploy.
// The session key of a request that names none (no X-Session-ID): njs in the router's nginx front door.
// A conversation whose history only grows keeps its first messages, so the system prompt and the first user
// message name it on every turn. The key is one of KEYS values, so the router's session table holds at most KEYS
// derived sessions; a body with no messages, or one that cannot be read, gets a key from the request's own id.
var crypto = require('crypto');

var KEYS_HEX = 4; // 16 bits: 65,536 keys

function bucket(hex) {
    return 'gf-' + hex.slice(0, KEYS_HEX);
}

// The items up to and including the first user message, with the top-level instructions ahead of them.
function opening(doc) {
    var items = Array.isArray(doc.messages) ? doc.messages : Array.isArray(doc.input) ? doc.input : null;
    if (items === null) {
        return null;
    }
    var head = [doc.system === undefined ? null : doc.system, doc.instructions === undefined ? null : doc.instructions];
    for (var i = 0; i < items.length; i++) {
        var item = items[i] || {};
        head.push([item.role === undefined ? null : item.role, item.content === undefined ? null : item.content]);
        if (item.role === 'user') {
            break;
        }
    }
    return JSON.stringify(head);
}

function session(r) {
    var text;
    try {
        text = r.requestText;
    } catch (e) {
        return bucket(r.variables.request_id); // nginx kept the body in a file (over client_body_buffer_size)
    }
    if (!text) {
        return '';
    }
    try {
        var head = opening(JSON.parse(text));
        if (head !== null) {
            return bucket(crypto.createHash('sha256').update(head).digest('hex'));
        }
    } catch (e) {
        // Not JSON: the worker answers it; the key below only places it.
    }
    return bucket(r.variables.request_id);
}

export default {session: session};
